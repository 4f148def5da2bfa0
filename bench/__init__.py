"""Benchmarks: reports, not tests (bench/README.md). Run each from the
repository root as a module, `python -m bench.bench_compute`, so it imports
the shared test helpers as the `tests` package."""
