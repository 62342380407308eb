"""Model directories the project can build and load offline: tokenizer, chat template, configs.

`build_tiny_model(arch, path)` writes a HuggingFace-format directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) with random weights that
`mlx_lm.load` opens with no network. The default model (scripts/train_default_model.py) uses
the same tokenizer recipe and chat template, trained instead of random.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

BOS, EOS, END = "<|bos|>", "<|eos|>", "<|end|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = [BOS, EOS, END, *(f"<|{role}|>" for role in ROLES), "<|pad|>"]

# Every message is "<|role|>\n" + content + "<|end|>\n"; a reply starts after "<|assistant|>\n".
# Messages start and end with special tokens, which split pre-tokenization, so a suffix
# appended later tokenizes exactly as the whole conversation would (tests check it).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TINY_CONFIGS: dict[str, dict] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "hidden_size": 128,
        "num_hidden_layers": 6,  # 5 sliding-window layers, then 1 global
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 64,
        "sliding_window": 64,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 4096,
    },
    "deepseek_v2": {
        "model_type": "deepseek_v2",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 64,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,  # K head dim 128 (nope 64 + rope 64), V head dim 64
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "topk_method": "greedy",
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        # mlx-lm's DeepSeek-V2 always reads rope_scaling; an explicit neutral one is needed
        "rope_scaling": {
            "type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
        },
    },
}


def stdlib_files(limit: int | None = None) -> list[Path]:
    """The Python standard library's own .py files: local text every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.parts) and p.is_file())
    return files[:limit] if limit else files


def read_texts(files: Iterable[Path]) -> Iterator[str]:
    for path in files:
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer with our special tokens, trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def write_tokenizer(path: Path, tokenizer) -> None:
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": "<|pad|>",
        "add_bos_token": False,  # the chat template adds it, once
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": [tokenizer.token_to_id(EOS), tokenizer.token_to_id(END)],
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_config(path: Path, config: dict, tokenizer) -> None:
    full = {
        **config,
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": [tokenizer.token_to_id(EOS), tokenizer.token_to_id(END)],
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(full, indent=2) + "\n")


def random_model(config: dict, seed: int = 0):
    """An mlx-lm model of `config`'s architecture with random float32 weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    # MoE gates start at zero, which routes every token alike; spread them out.
    gates = {
        k: mx.random.normal(v.shape) * 0.5
        for k, v in tree_flatten(model.parameters())
        if k.endswith("gate.weight")
    }
    if gates:
        model.load_weights(list(gates.items()), strict=False)
    mx.eval(model.parameters())
    return model


def save_model(path: Path, model, config: dict, tokenizer) -> Path:
    """Writes a directory mlx_lm.load opens offline."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(path / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    write_config(path, config, tokenizer)
    write_tokenizer(path, tokenizer)
    return path


def tiny_tokenizer(vocab_size: int = 512):
    """A small tokenizer trained in about a second on a slice of the standard library."""
    return train_tokenizer(read_texts(stdlib_files(limit=40)), vocab_size)


def build_tiny_model(arch: str, path: Path, tokenizer=None, seed: int = 0) -> Path:
    """A tiny random-weight model directory of architecture `arch` (see TINY_CONFIGS)."""
    tokenizer = tokenizer or tiny_tokenizer()
    config = {**TINY_CONFIGS[arch], "vocab_size": tokenizer.get_vocab_size()}
    return save_model(path, random_model(config, seed), config, tokenizer)
