"""GGML block quantizations decoded with numpy, as llama.cpp's ggml-quants.c lays them out.

Each decoder takes a tensor's blocks as a (blocks, bytes per block) uint8 array and returns
their weights in float32, every block at once. The products are formed in llama.cpp's order
(super-block scale times sub-block scale, then times the quant), so they are bit for bit
what gguf's `dequantize` gives. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K are also affine
with groups of 32, so they can stay quantized as MLX layers (`affine`); Q2_K, Q3_K and Q6_K
scale groups of 16, which MLX has no layout for.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights in a K-quant super-block
CHUNK_BLOCKS = 1 << 16  # blocks decoded at once: bounds the temporaries of a large tensor


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block, as a float32 column."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Per run of `width` bytes: their low nibbles, then their high nibbles."""
    runs = qs.reshape(len(qs), -1, width)
    return np.stack([runs & 0xF, runs >> 4], axis=-2).reshape(len(qs), -1)


def _crumbs(qs: np.ndarray, width: int) -> np.ndarray:
    """Per run of `width` bytes: their bits 0-1, then 2-3, 4-5 and 6-7."""
    runs = qs.reshape(len(qs), -1, 1, width)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((runs >> shifts) & 3).reshape(len(qs), -1)


def _bit_planes(h: np.ndarray) -> np.ndarray:
    """Bit 0 of every byte, then bit 1, ... bit 7: the K-quants' high bits (weight 32s + l
    takes bit s of byte l)."""
    bits = np.unpackbits(h[:, :, None], axis=-1, bitorder="little")
    return bits.swapaxes(1, 2).reshape(len(h), -1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit scales and mins packed in 12 bytes (get_scale_min_k4)."""
    low, high, both = (scales[:, i : i + 4] for i in (0, 4, 8))
    sc = np.concatenate([low & 63, (both & 0xF) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([high & 63, (both >> 4) | ((high >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _by_group(q: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """q (blocks, weights) times one scale (blocks, groups) per `group` weights."""
    return q.reshape(len(q), -1, group).astype(np.float32) * scale[:, :, None]


def _q4_0(b):
    return _f16(b, 0), _nibbles(b[:, 2:], 16), -8 * _f16(b, 0)


def _q4_1(b):
    return _f16(b, 0), _nibbles(b[:, 4:], 16), _f16(b, 2)


def _q8_0(b):
    return _f16(b, 0), b[:, 2:] ^ 0x80, -128 * _f16(b, 0)  # int8 + 128 as uint8


def _q5_0(b):
    high = np.unpackbits(b[:, 2:6], axis=1, bitorder="little")
    return _f16(b, 0), _nibbles(b[:, 6:], 16) | high << 4, -16 * _f16(b, 0)


def _q5_1(b):
    high = np.unpackbits(b[:, 4:8], axis=1, bitorder="little")
    return _f16(b, 0), _nibbles(b[:, 8:], 16) | high << 4, _f16(b, 2)


def _q2_k(b):
    scales = b[:, :16]
    dl, ml = _f16(b, 80) * (scales & 0xF), _f16(b, 82) * (scales >> 4)
    return _by_group(_crumbs(b[:, 16:80], 32), dl, 16) - ml[:, :, None]


def _q3_k(b):
    low = _nibbles(b[:, 96:104], 8)
    scales = (low | _crumbs(b[:, 104:108], 4) << 4).astype(np.float32) - 32
    q = _crumbs(b[:, 32:96], 32).astype(np.int8) - 4 * (1 - _bit_planes(b[:, :32])).astype(np.int8)
    return _by_group(q, _f16(b, 108) * scales, 16)


def _q4_k(b):
    sc, mins = _k_scales(b[:, 4:16])
    return _f16(b, 0) * sc, _nibbles(b[:, 16:], 32), -(_f16(b, 2) * mins)


def _q5_k(b):
    sc, mins = _k_scales(b[:, 4:16])
    q = _nibbles(b[:, 48:], 32) | _bit_planes(b[:, 16:48]) << 4
    return _f16(b, 0) * sc, q, -(_f16(b, 2) * mins)


def _q6_k(b):
    q = (_nibbles(b[:, :128], 64) | _crumbs(b[:, 128:192], 32) << 4).astype(np.int8) - 32
    return _by_group(q, _f16(b, 208) * b[:, 192:208].view(np.int8), 16)


def _affine(decode):
    """A float decoder from an affine one: scale * q + bias, one scale and bias per 32."""

    def to_float(blocks: np.ndarray) -> np.ndarray:
        scale, q, bias = decode(blocks)
        q = q.reshape(len(q), -1, 32).astype(np.float32)
        return scale[..., None] * q + bias[..., None]

    return to_float


# decoder, bits; each (scale, q, bias) per group of 32
AFFINE = {
    "Q4_0": (_q4_0, 4),
    "Q4_1": (_q4_1, 4),
    "Q5_0": (_q5_0, 5),
    "Q5_1": (_q5_1, 5),
    "Q8_0": (_q8_0, 8),
    "Q4_K": (_q4_k, 4),
    "Q5_K": (_q5_k, 5),
}
GROUP = 32  # weights per scale and bias of every AFFINE type
# type: (weights per block, bytes per block, decoder to float32)
BLOCKS = {
    "Q4_0": (32, 18, _affine(_q4_0)),
    "Q4_1": (32, 20, _affine(_q4_1)),
    "Q5_0": (32, 22, _affine(_q5_0)),
    "Q5_1": (32, 24, _affine(_q5_1)),
    "Q8_0": (32, 34, _affine(_q8_0)),
    "Q2_K": (QK_K, 84, _q2_k),
    "Q3_K": (QK_K, 110, _q3_k),
    "Q4_K": (QK_K, 144, _affine(_q4_k)),
    "Q5_K": (QK_K, 176, _affine(_q5_k)),
    "Q6_K": (QK_K, 210, _q6_k),
}
FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def nbytes(kind: str, size: int) -> int:
    """Bytes of `size` weights of type `kind` (a float or a BLOCKS type)."""
    if kind in FLOATS:
        return size * np.dtype(FLOATS[kind]).itemsize
    weights, block_bytes, _ = BLOCKS[kind]
    return size // weights * block_bytes


def block_weights(kind: str) -> int:
    return BLOCKS[kind][0] if kind in BLOCKS else 1


def dequantize(
    data: np.ndarray, kind: str, shape: tuple[int, ...], dtype: type = np.float32
) -> np.ndarray:
    """The weights `data` (raw bytes) holds, in float32 (F32 and F16 as they are). A block
    type decodes in float32 a chunk at a time, each chunk rounded to `dtype` as it lands: a
    float16 result never holds the whole tensor in float32."""
    if kind in ("F32", "F16"):
        return data.view(FLOATS[kind]).reshape(shape)
    if kind == "BF16":  # the upper half of a float32
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    weights, block_bytes, decode = BLOCKS[kind]
    blocks = data.reshape(-1, block_bytes)
    out = np.empty((len(blocks), weights), dtype=dtype)
    for start in range(0, len(blocks), CHUNK_BLOCKS):
        chunk = blocks[start : start + CHUNK_BLOCKS]
        out[start : start + len(chunk)] = decode(chunk).reshape(len(chunk), weights)
    return out.reshape(shape)


def affine(data: np.ndarray, kind: str, shape: tuple[int, ...]):
    """An AFFINE type as MLX affine quantization, group 32: (packed uint32 weights, fp16
    scales, fp16 biases), a chunk of blocks at a time. For the 32-weight blocks both are
    exact in fp16: the file's fp16 d and m, or d times a power of two. Q4_K's and Q5_K's are
    d and dmin times 6-bit sub-block factors, rounded to fp16 (a relative 2^-11 at most)."""
    decode, bits = AFFINE[kind]
    weights, block_bytes, _ = BLOCKS[kind]
    blocks = data.reshape(-1, block_bytes)
    packed = np.empty((len(blocks), weights * bits // 8), dtype=np.uint8)
    scales = np.empty((len(blocks), weights // GROUP), dtype=np.float16)
    biases = np.empty_like(scales)
    for start in range(0, len(blocks), CHUNK_BLOCKS):
        chunk = slice(start, start + CHUNK_BLOCKS)
        scale, q, bias = decode(blocks[chunk])
        packed[chunk] = _pack(q, bits).reshape(len(q), -1)
        scales[chunk], biases[chunk] = scale, bias  # rounded to fp16 as they land
    groups = (*shape[:-1], shape[-1] // GROUP)
    return (
        packed.view(np.uint32).reshape(*shape[:-1], -1),
        scales.reshape(groups),
        biases.reshape(groups),
    )


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Values under 2**bits packed as MLX packs them: each 8 in `bits` bytes, the first in
    the lowest bits (little-endian), so 4 and 8 bits fill whole uint32s as before."""
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    words = (q.reshape(-1, 8).astype(np.uint64) << shifts).sum(axis=-1, dtype=np.uint64)
    return words.view(np.uint8).reshape(-1, 8)[:, :bits]  # disjoint bits: the sum is their OR
