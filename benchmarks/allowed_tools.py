"""What allowed_tools keeps: a tool loop allowing some tools a step, against narrowed tools.

Each step allows some tools by OpenAI's tool_choice "allowed_tools" (the tools list whole),
or by sending only those tools, as clients did before allowed_tools.
A store, one worker and the gateway, each a process. The model has Qwen 2.5's chat template
(its tools block at the start of the prompt, json_tools calls) and SmolLM2-135M's shape
(30 layers, hidden 576; qwen2 architecture, random weights, a 512-token tokenizer: what
is timed is the prefill, which the weights do not change); no registry package ships a
small model with a tool-call template. Each of --turns steps resends the conversation with
a new question and allows the next two of --tools tools. The table gives, per step,
the prompt, the tokens read from the cache, the first token's time as the worker measured
it, and the call's wall time (the first step's includes the agent's creation, which
prefills the system prompt and the tools).
Run: python benchmarks/allowed_tools.py [--turns 6] [--tools 8]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import harness as h

SYSTEM = "You are an operations agent. Use the tools you are allowed."
ASKS = [
    "Find the failing job.", "Read its last log.", "Open a ticket for it.",
    "Restart the job.", "Check it is green now.", "Close the ticket.",
    "Summarize what happened.", "What should we watch next week?",
]  # fmt: skip
FIGURES = (("prompt", str), ("cached", str), ("ttft_ms", h.fmt), ("wall_ms", h.fmt))
SMOLLM2_SHAPE = {
    "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
}  # fmt: skip


def build_model(root: Path) -> Path:
    """The random-weight qwen2 model of SmolLM2-135M's shape, with Qwen 2.5's template."""
    from tests.model_kit import QWEN_CHAT, random_model, save_model, tiny_tokenizer, tool_config

    tokenizer = tiny_tokenizer(chat=QWEN_CHAT)
    config = tool_config(tokenizer.get_vocab_size()) | SMOLLM2_SHAPE
    return save_model(root / "model", random_model(config), config, tokenizer, QWEN_CHAT)


def tools(count: int) -> list[dict]:
    """`count` function tools of three parameters each."""
    properties = {
        "target": {"type": "string", "description": "What the step acts on."},
        "reason": {"type": "string", "description": "Why, in a sentence."},
        "urgent": {"type": "boolean"},
    }
    return [
        {"type": "function", "function": {
            "name": f"tool_{i}", "description": f"Operations step number {i}.",
            "parameters": {"type": "object", "properties": properties, "required": ["target"]},
        }}
        for i in range(count)
    ]  # fmt: skip


def loop(client, session: str, args, narrowed: bool) -> list[dict]:
    """--turns steps of one conversation: each one's prompt, cached tokens and TTFT."""
    every, messages, rows = tools(args.tools), [{"role": "system", "content": SYSTEM}], []
    for n, ask in enumerate(ASKS[: args.turns]):
        allowed = [every[(n + k) % len(every)] for k in range(2)]  # two tools a step
        names = [{"type": "function", "function": {"name": t["function"]["name"]}} for t in allowed]
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": names}}
        step = {"tools": allowed} if narrowed else {"tools": every, "tool_choice": choice}
        messages.append({"role": "user", "content": ask})
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model="m", messages=messages, max_tokens=args.max_tokens, temperature=0,
            extra_headers={"X-Session-ID": session}, **step,
        )  # fmt: skip
        message = reply.choices[0].message
        messages.append(
            message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
        )
        messages += [
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": True})}
            for call in message.tool_calls or ()
        ]
        wall = (time.perf_counter() - start) * 1e3
        ttft = reply.model_extra["agentkv"]["time_to_first_token_ms"]
        cached = reply.usage.prompt_tokens_details.cached_tokens
        rows.append({"prompt": reply.usage.prompt_tokens, "ttft_ms": ttft, "cached": cached})
        rows[-1]["wall_ms"] = wall
    return rows


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__, model=False, quick={"turns": 3, "tools": 4})
    p.add_argument("--turns", type=int, default=6, choices=range(1, len(ASKS) + 1))
    p.add_argument("--tools", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args(argv)
    if args.tools < 2:
        p.error("--tools: at least 2 (each step allows two)")
    from agentkv.launch import gateway_process

    with h.services(None) as svc:
        h.say("building the model ...")
        model = build_model(svc.root)
        svc.start_worker("w", model)
        flags = ["--model-name", "m"]
        log = svc.root / "gateway.log"
        gateway = svc.start(gateway_process([svc.addresses["w"]], log, extra_args=flags))
        import openai

        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
        ask = [{"role": "user", "content": ASKS[0]}]  # the worker's first turn warms it up
        client.chat.completions.create(model="m", messages=ask, max_tokens=args.max_tokens)
        h.say("allowed_tools ...")
        kept = loop(client, "allowed", args, narrowed=False)
        h.say("narrowed tools ...")
        narrowed = loop(client, "narrowed", args, narrowed=True)
    rows = [
        (n, *(shown(r[k]) for r in (a, b) for k, shown in FIGURES))
        for n, (a, b) in enumerate(zip(kept, narrowed, strict=True), 1)
    ]
    sections = [("each step allowing two tools", h.table(
        ["step", "prompt, allowed_tools", "cached", "TTFT ms", "call ms",
         "prompt, narrowed tools", "cached", "TTFT ms", "call ms"], rows))]  # fmt: skip
    header = {"model": "random qwen2 of SmolLM2-135M's shape, Qwen 2.5's template",
              "machine": h.machine()}  # fmt: skip
    document = {"allowed_tools": kept, "narrowed": narrowed}
    h.report("allowed_tools", args.out, header, sections, document=document)


if __name__ == "__main__":
    main()
