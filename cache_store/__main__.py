"""agentkv-store: the cache store process."""

from __future__ import annotations

import sys

from agentkv import logs
from agentkv.errors import AgentKVError
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
        message = exc.message if isinstance(exc, AgentKVError) else str(exc)
        sys.exit(f"agentkv-store: error: {message}")
    except KeyboardInterrupt:  # while it opens: once it serves, SIGINT stops it gracefully
        print("agentkv-store: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
