"""SLED's benchmarks, run as `sled-bench NAME` (bench.cli)."""
