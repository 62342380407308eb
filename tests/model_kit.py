"""Model directories the project can build and load offline: tokenizer, chat template, configs.

`build_tiny_model(arch, path)` writes a HuggingFace-format directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) with random weights that
`mlx_lm.load` opens with no network. The default model (scripts/train_default_model.py) uses
the same tokenizer recipe and chat template, trained instead of random.

`build_tool_model(path)` writes a scripted Qwen 2.5-style model (Qwen 2.5's own chat template)
whose greedy reply to any conversation is one tool call, TOOL_CALL.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ChatSpec:
    """A tokenizer's chat conventions: its control tokens, what ends a reply, its template."""

    template: str
    special_tokens: tuple[str, ...]  # trained in, "special" (decode may skip them)
    eos: tuple[str, ...]  # end a reply; the first is tokenizer_config's eos_token
    pad: str
    bos: str | None = None
    added_tokens: tuple[str, ...] = ()  # whole tokens, not special: decoded text keeps them


DEFAULT_CHAT = ChatSpec(CHAT_TEMPLATE, tuple(SPECIAL_TOKENS), (EOS, END), "<|pad|>", BOS)

# Qwen2.5-Instruct's own chat_template (tools, <tool_call> / <tool_response>, the default
# system prompt), byte for byte: tests/fixtures/chat_templates/qwen2_5.json, taken from
# llama.cpp's copy of Qwen/Qwen2.5-7B-Instruct's tokenizer_config.json (its "source" says
# where). Qwen/Qwen2.5-0.5B-Instruct's is the same text (e.g. the one quoted in
# ShishirPatil/gorilla's bfcl Qwen handler). mlx-lm infers the json_tools parser from it.
QWEN25_CHAT_TEMPLATE: str = json.loads(
    (Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2_5.json").read_text()
)["chat_template"]
TOOL_CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
WEATHER_TOOL = {  # the tool TOOL_CALL calls, as an OpenAI request names it
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TOOL_CALL_JSON = "\n" + json.dumps(TOOL_CALL) + "\n"  # between the markers: one added token
TOOL_REPLY = "<tool_call>" + TOOL_CALL_JSON + "</tool_call>"  # then <|im_end|>
QWEN_CHAT = ChatSpec(
    QWEN25_CHAT_TEMPLATE,
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    eos=("<|im_end|>",),
    pad="<|endoftext|>",
    added_tokens=(
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        TOOL_CALL_JSON,
    ),
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


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, special_tokens: Iterable[str] = SPECIAL_TOKENS
):
    """A byte-level BPE tokenizer with `special_tokens` (ours by default), trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def add_tokens(tokenizer, tokens: Iterable[str]):
    """`tokenizer` with `tokens` added whole, not special (as Qwen's <tool_call>)."""
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens])
    return tokenizer


def token_ids(tokenizer, chat: ChatSpec = DEFAULT_CHAT) -> dict:
    """The bos and eos token ids, as config.json and generation_config.json name them."""
    bos = tokenizer.token_to_id(chat.bos) if chat.bos else None
    return {"bos_token_id": bos, "eos_token_id": [tokenizer.token_to_id(t) for t in chat.eos]}


def write_tokenizer(path: Path, tokenizer, chat: ChatSpec = DEFAULT_CHAT) -> None:
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": chat.bos,
        "eos_token": chat.eos[0],
        "pad_token": chat.pad,
        "add_bos_token": False,  # the chat template adds it (if any), once
        "model_max_length": 1 << 20,
        "chat_template": chat.template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = token_ids(tokenizer, chat)
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_config(path: Path, config: dict, tokenizer, chat: ChatSpec = DEFAULT_CHAT) -> None:
    full = {
        **config,
        "vocab_size": tokenizer.get_vocab_size(),
        **token_ids(tokenizer, chat),
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


def save_model(path: Path, model, config: dict, tokenizer, chat: ChatSpec = DEFAULT_CHAT) -> Path:
    """Writes a directory mlx_lm.load opens offline."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(path / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    write_config(path, config, tokenizer, chat)
    write_tokenizer(path, tokenizer, chat)
    return path


def tiny_tokenizer(vocab_size: int = 512, chat: ChatSpec = DEFAULT_CHAT):
    """A small tokenizer trained in about a second on a slice of the standard library, with
    `chat`'s control tokens."""
    texts = read_texts(stdlib_files(limit=40))
    return add_tokens(train_tokenizer(texts, vocab_size, chat.special_tokens), chat.added_tokens)


def build_tiny_model(arch: str, path: Path, tokenizer=None, seed: int = 0) -> Path:
    """A tiny random-weight model directory of architecture `arch` (see TINY_CONFIGS)."""
    tokenizer = tokenizer or tiny_tokenizer()
    config = {**TINY_CONFIGS[arch], "vocab_size": tokenizer.get_vocab_size()}
    return save_model(path, random_model(config, seed), config, tokenizer)


def prompt_end(tokenizer, chat: ChatSpec) -> int:
    """The last token of a conversation rendered with `chat`'s generation prompt."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=chat.template)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text).ids[-1]


def scripted_model(config: dict, chain: list[int], seed: int = 0, margin: float = 40.0):
    """A model whose greedy decoding goes along `chain`: each token of it predicts the next.

    Every layer's o_proj and down_proj are zero, so attention and MLP add nothing and the last
    hidden state is the current token's embedding (RMS-normed, norm sqrt(hidden)); lm_head's
    row for each next token is its predecessor's embedding, unit length, times `margin` /
    sqrt(hidden): the logit `margin` where it follows, about N(0, (margin/sqrt(hidden))^2)
    elsewhere on those rows, 0 on all others."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    if len(set(chain[:-1])) != len(chain) - 1:
        raise ValueError(f"a token of {chain} would need two successors")
    model = random_model(config, seed)
    params = dict(tree_flatten(model.parameters()))
    weights = {
        k: mx.zeros_like(v)
        for k, v in params.items()
        if k.endswith(("o_proj.weight", "down_proj.weight"))
    }
    embed = np.array(params["model.embed_tokens.weight"])
    head = np.zeros_like(np.array(params["lm_head.weight"]))
    prev = embed[chain[:-1]]
    scale = margin / np.sqrt(embed.shape[1])
    head[chain[1:]] = scale * prev / np.linalg.norm(prev, axis=1, keepdims=True)
    weights["lm_head.weight"] = mx.array(head)
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    return model


def tool_config(vocab_size: int) -> dict:
    """TINY_CONFIGS["qwen2"] (untied lm_head) with head dim 64 instead of 32: the worker's
    default KV format quantizes groups of 64."""
    qwen2 = TINY_CONFIGS["qwen2"]
    heads = qwen2["hidden_size"] // 64
    return {
        **qwen2,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "vocab_size": vocab_size,
    }


def build_tool_model(path: Path, seed: int = 0) -> Path:
    """A tiny qwen2-architecture model directory (mlx_lm.load opens it offline) with Qwen 2.5's
    own chat template (tools included), that answers every conversation ending with the
    generation prompt with one tool call: TOOL_REPLY ("<tool_call>\\n" + json.dumps(TOOL_CALL)
    + "\\n</tool_call>", three tokens) and then <|im_end|> (its end of sequence), by greedy
    decoding. The prompt's last token ("\\n" after "<|im_start|>assistant") starts the chain."""
    tokenizer = tiny_tokenizer(chat=QWEN_CHAT)
    reply = tokenizer.encode(TOOL_REPLY).ids
    chain = [prompt_end(tokenizer, QWEN_CHAT), *reply, tokenizer.token_to_id(QWEN_CHAT.eos[0])]
    config = tool_config(tokenizer.get_vocab_size())
    return save_model(path, scripted_model(config, chain, seed), config, tokenizer, QWEN_CHAT)
