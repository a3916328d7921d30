"""Benchmarks, sweeps and their reports; the modules run from the repo root as `python -m experiments.<name>`."""
