"""The DFlash-against-EAGLE report on SmolLM2-135M (`experiments/distill_dflash_smollm2/report.py`): the
latest checkpoint of configs/distill_dflash_smollm2.py and the committed EAGLE head, decoded greedily at
K = 4 on held-out stdlib prompts.

  python -m experiments.distill_dflash_smollm2.report --config=configs/reports/distill_dflash.py
"""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.workdir = "workdirs/smollm2_dflash"  # the DFlash run's work directory
  cfg.eagle_head = "experiments/distill_eagle_smollm2/head"  # the committed EAGLE head (400 steps)
  cfg.k = 4  # draft tokens per round
  cfg.dtype = "float32"  # both models' dtype (bfloat16 only pays through the CPU matmul kernel, where it is built)
  cfg.dflash_vocab = 8192  # the DFlash head also decodes through this many most frequent stdlib tokens
  cfg.num_prompts = 4  # held-out prompts (the first `prompt_tokens` tokens of held-out stdlib files)
  cfg.prompt_tokens = 128
  cfg.max_new_tokens = 96  # per prompt, greedy, batch 1
  cfg.cost_repeats = 20  # timed proposals and target steps (the median is kept)
  cfg.output = "experiments/distill_dflash_smollm2/results.json"
  return cfg
