"""What each layer of a loaded mlx-lm model keeps in its KV cache, read from the model itself.

mlx-lm says which layers attend within a sliding window through the caches it would make
(`model.make_cache()`: a RotatingKVCache of `max_size` W for a sliding layer, a KVCache for a
full one). One probe token through the model gives each layer's KV head count and its K and
V head dims (DeepSeek-V2's MLA: 192 and 128). This drives cache creation, block layout,
restore and memory accounting for any model whose layers are one of those two kinds.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from agentkv.layers import LayerSpec
from inference_worker.models import ModelError


def model_layers(model: Any) -> list[LayerSpec]:
    """Each layer's spec, as the model computes it (agentkv.layers reads it from a config)."""
    windows = cache_windows(model)
    probes = [_Probe() for _ in windows]
    mx.eval(model(mx.array([[0]]), cache=probes))
    return [
        LayerSpec("full" if w is None else "sliding", w, p.shape_k[1], p.shape_k[3], p.shape_v[3])
        for w, p in zip(windows, probes, strict=True)
    ]


def cache_windows(model: Any) -> list[int | None]:
    """Per layer: its sliding window, or None for full attention."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    make = getattr(model, "make_cache", None)
    if make is None:
        return [None] * len(model.layers)
    windows: list[int | None] = []
    for layer, cache in enumerate(make()):
        if isinstance(cache, RotatingKVCache) and getattr(cache, "keep", 0) == 0:
            windows.append(cache.max_size)
        elif type(cache) is KVCache:
            windows.append(None)
        else:
            raise ModelError(
                f"{getattr(model, 'model_type', type(model).__name__)} layer {layer} uses "
                f"{type(cache).__name__}: agentkv caches full-attention and sliding-window "
                "layers only"
            )
    return windows


class _Probe:
    """A cache that records the K and V shapes a layer hands it."""

    offset = 0

    def __init__(self) -> None:
        self.shape_k: tuple[int, ...] = ()
        self.shape_v: tuple[int, ...] = ()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.shape_k, self.shape_v = tuple(keys.shape), tuple(values.shape)
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return None
