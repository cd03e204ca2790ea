"""Gateway benchmarks: the latency and throughput the gateway adds, against a bare SSE endpoint."""
