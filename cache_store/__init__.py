"""Cache store service: content-addressed Q4 KV blocks in LMDB + safetensors, over gRPC."""
