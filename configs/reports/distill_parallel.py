"""The PARD-against-autoregressive report on SmolLM2-135M (`experiments/distill_parallel_smollm2/report.py`):
the two runs of configs/distill_smollm2_parallel.py (`:parallel`, `:autoregressive`), their latest
checkpoints decoded greedily at K = 4 on held-out stdlib prompts.

  python -m experiments.distill_parallel_smollm2.report --config=configs/reports/distill_parallel.py
"""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.workdirs = ml_collections.ConfigDict({
      "parallel": "workdirs/smollm2_pard",  # the runs' work directories
      "autoregressive": "workdirs/smollm2_ar"
  })
  cfg.k = 4  # draft tokens per round
  cfg.num_prompts = 4  # held-out prompts (the first `prompt_tokens` tokens of held-out stdlib files)
  cfg.prompt_tokens = 128
  cfg.max_new_tokens = 96  # per prompt, greedy, batch 1
  cfg.cost_repeats = 20  # timed draft forwards per width (the median is kept)
  cfg.output = "experiments/distill_parallel_smollm2/results.json"
  return cfg
