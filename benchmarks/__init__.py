"""Benchmarks, run from the repository root as modules: ``python -m benchmarks.benchmark_long_context --help``.

Results land in ``benchmarks/results/``; ``benchmarks.lra`` is the Long Range Arena harness.
"""
