"""agentkv: persistent 4-bit KV-cache memory for multi-agent LLM inference.

This package holds what the store, the worker and the SDK share: the generated gRPC stubs
(`agentkv.v1`), typed errors, block keys, the raw-chunk wire fast path, and the CLI. The SDK
is `agentkv.client`: an installed wheel has it in agentkv/client/, a source checkout in its
top-level client/ folder, which the next lines let Python find there too (an editable install
maps it as well; this covers a checkout on sys.path ahead of a regular install).
"""

import os
from pathlib import Path

# gRPC's C core writes its own INFO lines to stderr ("I1205 ... chttp2_transport.cc ... Got
# goaway" when a peer stops or thaws) between the services' JSON lines. Its verbosity is read
# once, when grpc is imported, and every agentkv process imports this package first. An
# operator's GRPC_VERBOSITY still wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# gRPC's fork handlers let a child forked without exec use gRPC. agentkv forks none: it starts
# processes (exec), where the handlers can wait forever on gRPC's own threads in a process
# with live channels (CI's walkthrough hung in fork() restarting its worker). Read when grpc
# is imported, like the above; an application that needs them sets it to 1 itself.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"

_checkout = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "client").is_dir() and (_checkout / "client").is_dir():
    __path__.append(str(_checkout))
