"""pdserve decode worker: KV reservation, KV receive, continuous batching, token streaming."""
