"""Small-T matmuls (`python -m experiments.matmul_small_t --config=configs/benchmarks/matmul_small_t.py`):
T = 1..16 token rows times `[out, in]` weights on each matmul backend and dtype, timed, one JSON file.
"""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.matrices = 16  # random 8960 x 1536 weights cycled per call (16: 440 MB in float32, past any cache)
  cfg.output = "experiments/results/matmul_small_t_cpu.json"  # the JSON results ("" = print only)
  return cfg
