"""pdserve prefill worker: chunked prefill, first-token sampling, layer-by-layer KV send (imports nothing)."""
