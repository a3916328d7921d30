"""The forward-cost benchmark (`python -m experiments.forward_cost --config=configs/benchmarks/forward_cost.py`):
T-token forwards (T = 1, 2, 3, 4, 6, 8, 16) of the Qwen2.5-Coder-1.5B shape with random weights for each weight-matmul
backend and dtype, one subprocess per variant, one JSON file.
"""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.layers = 28  # transformer blocks (the target's 28; fewer keep the run short; the head stays full size)
  cfg.repeats = 7  # timed forwards per T (the median is kept)
  cfg.cache_len = 512  # positions of the KV cache the forwards attend into
  cfg.offset = 100  # cached positions before the T tokens (< cache_len - 16)
  cfg.variants = ("xla_float32", "kernel_float32", "xla_bfloat16", "kernel_bfloat16")  # forward_cost.VARIANTS
  cfg.output = "experiments/results/forward_cost_cpu.json"  # the JSON results ("" = print only)
  cfg.child = ""  # internal: set in the subprocess that measures one variant
  return cfg
