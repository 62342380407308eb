"""What an imported GGUF's weights should become on this device: dequantized or native.

Times a prefill and single-token decode steps of the model imported `float32` and `native`
(the worker's `--gguf-weights auto` picks float32 on CPU, native on a GPU).
Run: python benchmarks/gguf_weights.py [--model FILE.gguf|NAME] [--prefill 512] [--decode 32]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness as h

from inference_worker.blas import load_optimized_blas


def measure(path: Path, args: Any) -> dict[str, list[float]]:
    """ms of a prefill of --prefill tokens, and of --decode single-token steps over its cache."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(path))
    model.set_dtype(mx.float32)  # what the worker computes in on CPU (scales and biases too)
    ids = mx.array([[100 + i % 4000 for i in range(args.prefill)]])
    cache = make_prompt_cache(model)
    mx.eval(model(ids, cache=cache))

    def decode() -> None:
        for _ in range(args.decode):
            mx.eval(model(mx.array([[7]]), cache=cache))
        for c in cache:
            c.trim(args.decode)

    prefill = h.repeat(lambda: mx.eval(model(ids, cache=make_prompt_cache(model))), args.repeats)
    return {"prefill": prefill, "decode": h.repeat(decode, args.repeats)}


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    blas = load_optimized_blas()
    from inference_worker.models import SHIPPED, resolve_model

    if args.model not in SHIPPED and not args.model.endswith(".gguf"):
        sys.exit(f"--model {args.model}: a GGUF file or a shipped name")
    cache, times = Path(tempfile.mkdtemp(prefix="agentkv-gguf-weights-")), {}
    for weights in ("float32", "native"):
        h.say(f"importing and timing {weights} ...")
        times[weights] = measure(resolve_model(args.model, weights, "cpu", cache), args)
    print(f"model {args.model}, BLAS {blas or 'reference'}, {args.repeats} repeats\n")
    per_step = {w: f"{statistics.median(t['decode']) / args.decode:.1f}" for w, t in times.items()}
    rows = [
        (w, h.span(t["prefill"], 0), h.span(t["decode"], 0), per_step[w]) for w, t in times.items()
    ]
    headers = ("weights", f"prefill {args.prefill} tok ms (min / median / max)")
    print(h.table((*headers, f"{args.decode} decode steps ms", "ms per decode step"), rows))
    f32, native = (statistics.median(times[w]["decode"]) for w in ("float32", "native"))
    print(f"\ndecode: float32 is {native / f32:.2f}x faster than native on this device")


if __name__ == "__main__":
    main()
