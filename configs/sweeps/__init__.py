"""Sweep configs for `python -m experiments.sweep`: a base decode config, the axes of the grid, a table."""
