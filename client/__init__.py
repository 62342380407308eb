"""Python SDK for agentkv: store client and locate reader."""
