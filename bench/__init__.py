"""Benchmarks: each compares both sides on one machine in one run. Run from the repository root
as modules (``python -m bench.bench_getbatch``), so they import the installed ``batchfs`` and the
tests' process helpers (``tests.support``) without editing ``sys.path``."""
