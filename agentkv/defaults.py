"""What a fresh install uses when told nothing else: one place for each default."""

from __future__ import annotations

STORE_ADDRESS = "127.0.0.1:50051"  # agentkv-store --listen, and every client's --store
WORKER_ADDRESS = "127.0.0.1:50061"  # agentkv-worker --listen, and every client's --worker
GATEWAY_ADDRESS = "127.0.0.1:8000"  # agentkv-gateway --listen: OpenAI's API over HTTP
MODEL = "smollm2-135m-instruct"  # a shipped model's name (inference_worker/models.py)
