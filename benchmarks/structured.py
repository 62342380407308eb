"""What structured output costs: a reply held to a JSON Schema against the same reply free.

One worker process of --model (SmolLM2-135M by default). --agents agents at once ask the
same question, free and then with a bounded JSON Schema, greedy; the table gives the decode
speed the worker measured, the tokens, and how many replies were JSON the schema accepts.
Then, in process, the per-step cost of the masks alone (llguidance) for a batch of 1 to 8
constrained rows on the model's vocabulary, and what holding a turn's calls to strict tools
costs: at its submit (compiling the calls' grammar, its first mask; or copying one the
worker keeps), for 1 to 32 tools of four parameters, and in its masks; calls as json_tools
writes them, between two of the model's special tokens.
Run: python benchmarks/structured.py [--model SPEC] [--agents 4] [--max-tokens 64]
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import harness as h

SYSTEM = "You are a helpful assistant. Answer in JSON with keys city, country, population."
QUESTIONS = ["What is the capital of France?", "What is the capital of Japan?"]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
    },
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}


def turns(worker, kind: str, args) -> list:
    """--agents concurrent greedy turns, free or held to SCHEMA: their TurnResults."""
    form = {"output_format": SCHEMA} if kind == "json" else {}
    results: list = [None] * args.agents

    def run(i: int) -> None:
        agent = f"{kind}-{i}"
        worker.create_agent("structured", agent, SYSTEM)
        ask = [("user", QUESTIONS[i % len(QUESTIONS)])]
        results[i] = worker.turn("structured", agent, ask, max_tokens=args.max_tokens, **form)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(args.agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def valid(result) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads("".join(result.pieces)), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return result.usage.finish_reason == "stop"


def mask_ms(path, rows: int, steps: int, strict: bool = False) -> float:
    """Median ms of one step's masks for `rows` constrained rows (random logits; the
    argmax taken, as a greedy step): held to SCHEMA, or, `strict`, to 8 strict tools'
    calls (text, or calls, as random logits choose)."""
    import mlx.core as mx

    from inference_worker.grammar import Ask, OutputForm
    from inference_worker.masks import masked

    grammars, eos = _tool_grammars(path)
    ask, tools = Ask(OutputForm("json_schema", json.dumps(SCHEMA))), ""
    if strict:
        ask, tools = Ask(), _strict_tools(8)
    constraints = [grammars.forms(ask, tools).constraint(tools) for _ in range(rows)]
    times = []
    for _ in range(steps):
        logprobs = mx.random.normal((rows, grammars.vocab))
        mx.eval(logprobs)
        start = time.perf_counter()
        out, _ = masked(logprobs, constraints)
        tokens = mx.argmax(out, axis=-1).tolist()
        times.append((time.perf_counter() - start) * 1e3)
        for c, token in zip(constraints, tokens, strict=True):
            if c.done or token in eos:
                return statistics.median(times)
            c.take(token)
    return statistics.median(times)


def strict_ms(path, count: int, repeats: int = 5) -> tuple[float, float, float]:
    """Median ms to compile a turn's forms at submit for `count` strict tools: tools new
    to the worker, the same tools again (a kept grammar, copied), and an agent's own tools
    settled at its turn's start (compiled at its creation: copied)."""
    from inference_worker.grammar import Ask

    grammars, _ = _tool_grammars(path)
    grammars.forms(Ask(), _strict_tools(count, "warm-up"))  # llguidance's tokenizer, once
    new, again, own = [], [], []
    for i in range(repeats):
        tools = _strict_tools(count, str(i))
        for times in (new, again):
            start = time.perf_counter()
            assert grammars.forms(Ask(), tools) is not None
            times.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()  # an agent's own tools, at its turn's start (MLX thread)
        assert grammars.settled(None, tools) is not None
        own.append((time.perf_counter() - start) * 1e3)
    return statistics.median(new), statistics.median(again), statistics.median(own)


def _tool_grammars(path) -> tuple:
    """(Grammars, end-of-sequence ids) of the model's tokenizer, its calls json_tools'
    between two of its special tokens (SmolLM2's template writes no calls)."""
    from mlx_lm.tokenizer_utils import load

    from inference_worker.chat import ChatFormat
    from inference_worker.grammar import Grammars
    from inference_worker.tools import ToolFormat

    tokenizer = load(path)
    opening, closing = tokenizer.all_special_tokens[:2]
    calls = ToolFormat("json_tools", opening, closing, lambda text, tools: json.loads(text))
    eos = ChatFormat(tokenizer).eos_ids
    return Grammars(tokenizer, eos, calls), eos


def _strict_tools(count: int, salt: str = "") -> str:
    """`count` strict tools of four parameters, as canonical tools; `salt` in their
    parameters' title makes them new to a worker (a grammar it has not compiled)."""
    from inference_worker.tools import canonical_tools

    properties = SCHEMA["properties"] | {"on": {"type": "boolean"}}
    parameters = {"type": "object", "properties": properties, "additionalProperties": False}
    parameters["title"] = salt
    functions = [
        {"name": f"tool_{i}", "strict": True, "parameters": parameters} for i in range(count)
    ]
    return canonical_tools(json.dumps([{"type": "function", "function": f} for f in functions]))


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__, quick={"agents": 2, "max_tokens": 24})
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    h.open_model(args)
    rows = []
    with h.services(None, args.path, {"w": []}) as svc:
        for kind in ("free", "json"):
            h.say(f"{args.agents} agents, {kind} ...")
            results = turns(svc.workers["w"], kind, args)
            speed = statistics.median(r.usage.decode_tokens_per_second for r in results)
            tokens = sum(r.usage.generated_tokens for r in results)
            ok = sum(valid(r) for r in results)
            rows.append((kind, args.agents, f"{speed:.1f}", tokens, f"{ok} of {len(results)}"))
    masks = [
        (n, f"{mask_ms(args.path, n, 24):.2f}", f"{mask_ms(args.path, n, 24, True):.2f}")
        for n in (1, 4, 8)
    ]
    strict = [(n, *(f"{ms:.1f}" for ms in strict_ms(args.path, n))) for n in (1, 8, 32)]
    sections = [
        ("free vs held to a JSON Schema (decode)", h.table(
            ["reply", "agents", "decode tok/s (median)", "tokens", "JSON the schema accepts"],
            rows,
        )),
        ("the masks alone, per step (ms, median)", h.table(
            ["constrained rows", "held to the JSON Schema", "8 strict tools"], masks
        )),
        ("strict tools at a turn's submit (ms, median)", h.table(
            ["tools", "new to the worker: compiled", "the same again: copied",
             "an agent's own, at a turn's start"], strict
        )),
    ]  # fmt: skip
    header = {"model": args.described, "machine": h.machine()}
    h.report(
        "structured",
        args.out,
        header,
        sections,
        document={"decode": rows, "masks": masks, "strict": strict},
    )


if __name__ == "__main__":
    main()
