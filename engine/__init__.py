"""pdserve engine: model loading, KV cache, attention, sampling, scheduling (imports nothing here)."""
