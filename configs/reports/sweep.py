"""The markdown table of a sweep table (`python -m experiments.report_sweep`), `<sweep>` naming a config
of configs/sweeps/ whose table is `experiments/results/sweep_<sweep>.jsonl`:

  python -m experiments.report_sweep --config=configs/reports/sweep.py:qwen_coder_k
  python -m experiments.report_sweep --config=configs/reports/sweep.py --config.table=PATH.jsonl
"""

import ml_collections


def get_config(sweep: str = ""):
  cfg = ml_collections.ConfigDict()
  cfg.table = f"experiments/results/sweep_{sweep}.jsonl" if sweep else ""  # the JSONL table (required)
  return cfg
