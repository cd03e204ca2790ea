"""Serving benchmarks: disaggregated vs colocated under load, TTFT of a disaggregated request, the pipeline on
CPU, greedy parity between two live systems."""
