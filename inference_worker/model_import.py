"""`agentkv model import FILE|NAME [--out DIR] [--weights W]`: the CLI runs this module as a
process of its own (python -m inference_worker.model_import), so that the CLI imports none of
the worker's modules."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from agentkv.entry import interrupted, interrupted_exit, unwind_on_sigterm


def main(argv: list[str] | None = None) -> None:
    """Prints the imported directory's path, or one line saying why not (exit 2). A Ctrl-C,
    even while the modules load, leaves nothing half-written and says so (exit 130)."""
    unwind_on_sigterm()
    try:
        _import(argv)
    except (KeyboardInterrupt, ImportError) as exc:
        if not interrupted(exc):
            raise
        interrupted_exit(exc, "")


def _import(argv: list[str] | None) -> None:
    from agentkv.errors import os_error_words
    from inference_worker.gguf_import import WEIGHTS, cached_import, import_gguf
    from inference_worker.models import SHIPPED, is_gguf, shipped_file

    p = argparse.ArgumentParser(prog="agentkv model import")
    p.add_argument("file")
    p.add_argument("--out", type=Path)
    p.add_argument("--weights", default="float32", choices=WEIGHTS)
    args = p.parse_args(argv)
    started = time.perf_counter()
    try:
        path = shipped_file(args.file) if args.file in SHIPPED else Path(args.file)
        if not path.exists():
            raise ValueError(f"{path}: no such file or directory")
        if not path.is_file() or not is_gguf(path):
            raise ValueError(f"{path} is not a GGUF file")
        out = (
            import_gguf(path, args.out, args.weights)
            if args.out
            else cached_import(path, args.weights)
        )
    except (ValueError, OSError) as exc:  # GGUFError and ModelError are ValueErrors
        said = os_error_words(exc) if isinstance(exc, OSError) else str(exc)  # no [Errno N]
        print(f"error: {said}", file=sys.stderr)
        sys.exit(2)
    print(f"{out}  ({time.perf_counter() - started:.1f} s; serve it with --model {out})")


if __name__ == "__main__":
    main()
