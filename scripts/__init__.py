"""Set-up, test and demo scripts; `scripts.bench` holds the benchmarks, `scripts.examples` the examples."""
