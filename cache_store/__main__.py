"""agentkv-store: the cache store process."""

from __future__ import annotations

if __name__ == "__main__":  # python -m: its imports below run as the console script's do
    from agentkv.entry import store

    store()
    raise SystemExit

import sys

from agentkv import logs
from agentkv.errors import AgentKVError, os_error_words
from agentkv.flags import parse_config
from cache_store.config import StoreConfig
from cache_store.server import serve


def build_config(argv: list[str] | None = None) -> StoreConfig:
    return parse_config(StoreConfig, "agentkv-store", __doc__, argv)


def main(argv: list[str] | None = None) -> None:
    config = build_config(argv)
    logs.configure(config.log_level)
    try:
        serve(config)
    except (AgentKVError, OSError) as exc:  # at start-up: a data dir in use, a bad index
        # exit 2, as the worker and the gateway do when they cannot start
        print(f"agentkv-store: error: {_said(exc)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # while it opens: once it serves, SIGINT stops it gracefully
        print("agentkv-store: interrupted", file=sys.stderr)
        sys.exit(130)


def _said(exc: AgentKVError | OSError) -> str:
    return exc.message if isinstance(exc, AgentKVError) else os_error_words(exc)
