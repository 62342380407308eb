"""MLX inference worker (built in a later issue)."""
