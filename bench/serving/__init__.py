"""Serving benchmarks: disaggregated vs colocated under load, TTFT of a disaggregated request, multi-turn
agent sessions with prefix reuse on vs off, the pipeline on CPU, greedy parity between two live systems."""
