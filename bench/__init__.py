"""Benchmarks (not tests), one folder per subject, each module runnable as
``python -m bench.<subject>.<name>``: ``engine/``, ``kernels/``, ``kvtransfer/``, ``serving/``,
``gateway/``; shared: ``common`` (model flags, prompts), ``argtypes`` (range-checked numeric flags),
``timing`` (warm-up, repeats, spread), ``ceilings`` (GEMM and copy ceilings), ``machine``. Current
figures, their commands and the method: docs/benchmarks/README.md."""
