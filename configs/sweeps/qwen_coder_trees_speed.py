"""Trees against chains at batch 1 (the latency regime) on the real pair: tokens/s of the chains K = 4
and 8, three 14-16-node static trees and a 16-node dynamic tree, greedy and at temperature 1, 2 chat coding
prompts, 96 tokens, with the autoregressive baseline. About 20 minutes alone on 2 CPU cores. See `qwen_coder_trees.py`.

  python -m experiments.sweep --config=configs/sweeps/qwen_coder_trees_speed.py
"""

from configs.sweeps import qwen_coder_trees


def get_config():
  cfg = qwen_coder_trees.get_config()
  cfg.base.prompts = cfg.base.prompts[:2]
  cfg.base.max_new_tokens = 96
  cfg.base.batch_size = 1
  cfg.axes.k = (4, 8)
  cfg.axes.tree = ("",) + tuple(qwen_coder_trees.TREES[i] for i in (0, 2, 4, 5))
  cfg.output = "experiments/results/sweep_qwen_coder_trees_speed.jsonl"
  return cfg
