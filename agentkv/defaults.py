"""What a fresh install uses when told nothing else: one place for each default."""

from __future__ import annotations

STORE_ADDRESS = "127.0.0.1:50051"  # agentkv-store --listen, and every client's --store
WORKER_ADDRESS = "127.0.0.1:50061"  # agentkv-worker --listen, and every client's --worker
MODEL = "smollm2-135m-instruct"  # a shipped model's name (inference_worker/models.py)
