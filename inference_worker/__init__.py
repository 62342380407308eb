"""The MLX inference worker: restores agents' Q4 caches from the store and serves their turns."""
