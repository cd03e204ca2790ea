"""Kernel benchmarks and checks: decode-shaped GEMMs, paged decode attention, the compute-sanitizer driver."""
