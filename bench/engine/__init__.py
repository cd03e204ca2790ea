"""Engine benchmarks: throughput against transformers and the HBM roofline, prefill against the GEMM ceiling,
where a decode step's time goes, block allocation."""
