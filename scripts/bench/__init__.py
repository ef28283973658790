"""Benchmarks, run from the repository root as `python -m scripts.bench.NAME` (see docs/benchmarks.md).

Each reports ratios against a baseline measured in the same run; results are appended to
scripts/bench/results.json."""
