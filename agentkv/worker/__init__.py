"""Generated stubs for the worker contract."""
