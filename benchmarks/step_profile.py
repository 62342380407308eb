"""Where agentkv's model step spends its time against mlx-lm's own cache, in this process.

The real model (--model), its caches filled with random K/V at each context (a step's cost
does not depend on the values): a 15-token turn and one decode step over mlx-lm's KVCache
(fp), agentkv's QuantizedKV as the worker runs it (a turn attends the past dequantized, a
decode step attends Q4 by quantized matmul), and QuantizedKV dequantizing for every query
(the cost a dequantized decode path would have without a kept copy). Interleaved repeats.
Run: python benchmarks/step_profile.py [--contexts 1024,4096,8192] [--passes 7]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import harness as h

from inference_worker.blas import load_optimized_blas

TURN = 15  # tokens of a typical turn: the reply's closing, a short message, the header


def caches(model: Any, kind: str, n: int) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from agentkv.layers import KVFormat
    from inference_worker.kv_cache import QuantizedKV

    out = []
    for layer in model.layers:
        attn = layer.self_attn
        heads, dim = attn.n_kv_heads, attn.k_proj.weight.shape[0] // attn.n_kv_heads
        if kind == "fp":
            cache = KVCache()
        else:
            cache = QuantizedKV(KVFormat(), quantized_query_max=0 if kind == "deq" else 1)
        cache.update_and_fetch(*(mx.random.normal((1, heads, n, dim)) for _ in "kv"))
        out.append(cache)
    mx.eval([c.state for c in out])
    return out


def step(model: Any, cache: list, tokens: int, turn: bool) -> float:
    """ms of one forward of `tokens` tokens (a turn between begin_turn and end_turn on
    agentkv's cache, as the worker runs it), then the cache is trimmed back."""
    import mlx.core as mx

    quantized = hasattr(cache[0], "begin_turn")
    if turn and quantized:
        for c in cache:
            c.begin_turn()
    start = time.perf_counter()
    mx.eval(mx.argmax(model(mx.array([[7] * tokens]), cache=cache)[0, -1]))
    took = (time.perf_counter() - start) * 1e3
    for c in cache:
        if quantized:
            c.end_turn()
        c.trim(tokens)
    return took


def main() -> None:
    quick = {"contexts": [1024], "passes": 3}
    args = h.parser(__doc__, contexts=(1024, 4096, 8192), passes=7, quick=quick).parse_args()
    load_optimized_blas()
    from inference_worker.runtime import load_model

    model = load_model(h.model_dir(args.model), "float32")[0]
    kinds = {"fp": "mlx-lm KVCache (fp)", "q4": "agentkv QuantizedKV (Q4)"}
    kinds["deq"] = "QuantizedKV, every query dequantized"
    rows, found = [], {}
    for n in args.contexts:
        built = {k: caches(model, k, n) for k in kinds}
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.passes + 1):  # the first is a warm-up
            for k, cache in built.items():
                for what, tokens in (("turn", TURN), ("decode", 1)):
                    took = step(model, cache, tokens, what == "turn")
                    times.setdefault((k, what), []).append(took)
        for (k, what), values in times.items():
            s = h.spread(values[1:])
            found[f"{n} {k} {what}"] = s
            fp = statistics.median(times[("fp", what)][1:])
            rows.append([h.label(n), kinds[k], what, *(f"{s[x]:.1f}" for x in s),
                         f"{s['median'] / fp:.2f}x"])  # fmt: skip
    heads = ["context", "cache", f"step ({TURN}-token turn or 1-token decode)", "min ms"]
    sections = [("a model step, in process", h.table([*heads, "median ms", "max ms", "vs fp"],
                 rows, "lllrrrr"))]  # fmt: skip
    h.report("step_profile", args.out, h.machine(model=args.model), sections, (), (), found)


if __name__ == "__main__":
    main()
