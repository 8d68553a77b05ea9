"""Benchmarks: `spectandem bench` (benchmarks/bench/) and the standalone scripts beside it. They
sit above the roles and may import any of them."""
