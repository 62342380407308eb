"""A GGUF file's tokenizer rebuilt with `tokenizers`: byte-level BPE ("gpt2") or
sentencepiece BPE ("llama"), with the special tokens the file marks as control.

The pre-tokenizer comes from `tokenizer.ggml.pre`, llama.cpp's name for how text is split
before BPE; one agentkv does not know is refused rather than guessed, since a wrong split
gives other token ids.
"""

from __future__ import annotations

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


class GGUFError(ValueError):
    """A GGUF file agentkv cannot import; the message says why in one line."""


_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GPT2_LIKE = ("default", "gpt2", "smollm")


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _GPT2_LIKE:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if pre != "smollm":
            return byte_level
        # llama.cpp's smollm split: every digit alone, then GPT-2's pattern
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    known = ", ".join(sorted([*_SPLITS, *_GPT2_LIKE]))
    raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported (agentkv knows {known})")


MAX_TOKEN_CHARS = 4096


def vocabulary(meta: dict) -> list[str]:
    """The file's tokens, in id order."""
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError("GGUF metadata lacks tokenizer.ggml.tokens (the vocabulary)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    longest = max(range(len(tokens)), key=lambda i: len(tokens[i]), default=None)
    if longest is not None and len(tokens[longest]) > MAX_TOKEN_CHARS:  # no model's is near
        raise GGUFError(  # it: a merge table rebuilt from it takes time squared in its length
            f"GGUF tokenizer.ggml.tokens[{longest}] is {len(tokens[longest]):,} characters "
            f"long, past the {MAX_TOKEN_CHARS:,} a token may be"
        )
    return tokens


def _token(meta: dict, tokens: list[str], key: str) -> str | None:
    """The token `tokenizer.ggml.{key}` names, None without one; an id past the
    vocabulary is a GGUFError, not a token guessed."""
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    index = int(_item(value))
    if not 0 <= index < len(tokens):
        raise GGUFError(
            f"GGUF tokenizer.ggml.{key} {index} is past the vocabulary ({len(tokens)} tokens)"
        )
    return tokens[index]


def _byte_level(meta: dict):
    from tokenizers import Tokenizer, decoders, models

    tokens = vocabulary(meta)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [_merge(m, i, vocab) for i, m in enumerate(meta.get("tokenizer.ggml.merges", []))]
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _merge(merge: object, i: int, vocab: dict[str, int]) -> tuple[str, str]:
    """One of tokenizer.ggml.merges: two tokens of the vocabulary, a space apart; anything
    else is the file's error, not the tokenizers library's ("failed to extract enum")."""
    left, _, right = str(merge).partition(" ")
    if not (isinstance(merge, str) and left in vocab and right in vocab):
        raise GGUFError(
            f"GGUF tokenizer.ggml.merges[{i}] {str(merge)[:80]!r} is not two tokens of the "
            "vocabulary, a space apart"
        )
    return left, right


def _sentencepiece(meta: dict):
    """Sentencepiece BPE: the merges are not in the file, so they are rebuilt from the
    vocabulary: every token split in two known halves, best-ranked tokens first."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = [_respell(t) for t in vocabulary(meta)]
    vocab = {t: i for i, t in enumerate(tokens)}
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    scores = meta.get("tokenizer.ggml.scores")
    # Gemma's scores do not follow its merge order; its file order does.
    rank = (lambda i: i) if gemma or scores is None else (lambda i: -float(scores[i]))
    merges = []
    for i, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((rank(i), vocab[left], vocab[right], left, right))
    merges.sort()
    unk = _token(meta, tokens, "unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab,
            [(m[3], m[4]) for m in merges],
            unk_token=tokens[0] if unk is None else unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    replace = normalizers.Replace(" ", "\u2581")
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not gemma))
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if prefix else replace
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return tokenizer


def _respell(token: str) -> str:
    """Gemma stores tokens of spaces as spaces; the vocabulary spells them with '▁'."""
    return "\u2581" * len(token) if token and not token.strip(" ") else token


def _item(value):
    return value.item() if hasattr(value, "item") else value


def build_tokenizer(meta: dict):
    """The `tokenizers.Tokenizer` the file's metadata describes."""
    from tokenizers import AddedToken

    kind = str(meta.get("tokenizer.ggml.model", ""))
    if kind == "gpt2":
        tokenizer = _byte_level(meta)
    elif kind == "llama":
        tokenizer = _sentencepiece(meta)
    else:
        raise GGUFError(f"GGUF tokenizer {kind!r} is not supported (agentkv builds gpt2, llama)")
    tokens = vocabulary(meta)
    types = [int(t) for t in _tolist(meta.get("tokenizer.ggml.token_type", []))]
    special = [t for t, k in zip(tokens, types, strict=False) if k == CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    plain = [t for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    return tokenizer


def _tolist(value):
    return value.tolist() if hasattr(value, "tolist") else list(value)


def tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json: special tokens by name, the chat template, BOS behaviour."""
    tokens = vocabulary(meta)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(meta, tokens, "bos_token_id"),
        "eos_token": _token(meta, tokens, "eos_token_id"),
        "unk_token": _token(meta, tokens, "unknown_token_id"),
        "pad_token": _token(meta, tokens, "padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": 1 << 20,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = str(meta["tokenizer.chat_template"])
    return {k: v for k, v in config.items() if v is not None}
