"""Generated gRPC stubs for protos/agentkv/v1 (scripts/gen_protos.py); do not edit."""
