"""Benchmark configs: one get_config() per benchmark script in experiments/ (`--config=configs/benchmarks/...`)."""
