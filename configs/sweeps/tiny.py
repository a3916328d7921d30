"""A two-point sweep for tests: the autoregressive baseline and speculative K = 2 on the tiny HF
directories that the tests write and pass with --config.base.target / --config.base.draft."""

import ml_collections

from configs import tiny


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.base = tiny.get_config()  # the decode config of every point (configs/tiny.py documents its fields)
  cfg.base.max_new_tokens = 8  # a short budget keeps the test fast
  cfg.axes = ml_collections.ConfigDict()  # decode field -> values; the grid is their cartesian product
  cfg.axes.mode = ("autoregressive", "speculative")  # the baseline is a point of the grid
  cfg.axes.k = (2,)  # one K (unused by the autoregressive point)
  cfg.output = "/tmp/specjax_sweep_tiny.jsonl"  # JSONL table; tests pass their own path
  cfg.measure_cost = True  # time 1-token forwards of both models for the cost ratio c
  cfg.cost_repeats = 3  # timed calls per model (the median is kept)
  return cfg
