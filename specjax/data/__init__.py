"""Benchmark data that reaches us as pinned PyPI wheels (`registry`), and readers for it (`mtbench`)."""
