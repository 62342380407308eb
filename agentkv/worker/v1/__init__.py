"""Generated gRPC stubs for protos/agentkv/worker/v1 (scripts/gen_protos.py); do not edit."""
