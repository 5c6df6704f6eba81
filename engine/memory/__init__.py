"""Device memory the engine manages itself: the paged KV cache and its block pool."""
