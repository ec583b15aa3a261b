"""Benchmarks: `python -m benchmarks [AREA ...]` runs `benchmarks/bench_<area>.py` modules."""
