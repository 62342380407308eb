"""agentkv: persistent 4-bit KV-cache memory for multi-agent LLM inference.

This package holds what the store, the worker and the SDK share: the generated gRPC stubs
(`agentkv.v1`), typed errors, block keys, the raw-chunk wire fast path, and the CLI.
"""

__version__ = "0.1.0"
