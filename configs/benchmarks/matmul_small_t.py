"""Small-T matmuls (`python -m experiments.matmul_small_t --config=configs/benchmarks/matmul_small_t.py`):
four ways to contract T = 1..9 token rows with `[out, in]` weights on XLA CPU, timed, one JSON file.
"""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.matrices = 8  # random 8960 x 1536 float32 weights contracted per call (8: ~2.7 Qwen-1.5B MLPs)
  cfg.output = "experiments/results/matmul_small_t_cpu.json"  # the JSON results ("" = print only)
  return cfg
