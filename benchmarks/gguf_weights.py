"""What an imported GGUF's weights should become on this device: dequantized or native.

Times a prefill and single-token decode steps of the model imported `float32` and `native`
(the worker's `--gguf-weights auto` picks float32 on CPU, native on a GPU).
Run: python benchmarks/gguf_weights.py [--model FILE.gguf|NAME] [--prefill 512] [--decode 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from harness import repeat, span, table

from inference_worker.blas import load_optimized_blas


def measure(path: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(path))
    model.set_dtype(mx.float32)  # what the worker computes in on CPU (scales and biases too)
    ids = mx.array([[100 + i % 4000 for i in range(args.prefill)]])

    def prefill():
        mx.eval(model(ids, cache=make_prompt_cache(model)))

    cache = make_prompt_cache(model)
    mx.eval(model(ids, cache=cache))

    def decode():
        for _ in range(args.decode):
            mx.eval(model(mx.array([[7]]), cache=cache))
        for c in cache:
            c.trim(args.decode)

    return {"prefill": repeat(prefill, args.repeats), "decode": repeat(decode, args.repeats)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF file or shipped name")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    blas = load_optimized_blas()
    from inference_worker.models import SHIPPED, resolve_model

    if args.model not in SHIPPED and not args.model.endswith(".gguf"):
        sys.exit(f"--model {args.model}: a GGUF file or a shipped name")
    cache = Path(tempfile.mkdtemp(prefix="agentkv-gguf-weights-"))
    rows = {}
    for weights in ("float32", "native"):
        print(f"importing and timing {weights} ...", file=sys.stderr, flush=True)
        rows[weights] = measure(resolve_model(args.model, weights, "cpu", cache), args)
    print(f"model {args.model}, BLAS {blas or 'reference'}, {args.repeats} repeats\n")
    cells = [
        (
            w,
            span(r["prefill"], 0),
            span(r["decode"], 0),
            f"{statistics.median(r['decode']) / args.decode:.1f}",
        )
        for w, r in rows.items()
    ]
    headers = ("weights", f"prefill {args.prefill} tok ms (min / median / max)")
    print(table((*headers, f"{args.decode} decode steps ms", "ms per decode step"), cells))
    f32, nat = (statistics.median(rows[w]["decode"]) for w in ("float32", "native"))
    print(f"\ndecode: float32 is {nat / f32:.2f}x faster than native on this device")


if __name__ == "__main__":
    main()
