"""Trees against chains on the real pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft), for the
accepted tokens per round: chains of K = 4, 8 and 16, five static trees of 14-16 draft nodes and two
dynamic (EAGLE-2) trees of 16, greedy and at
temperature 1 (children drawn without replacement), batch 4, 8 chat coding prompts, 128 tokens.
About 50 minutes alone on 2 CPU cores; `qwen_coder_trees_speed.py` times a subset at batch 1.

  python -m experiments.sweep --config=configs/sweeps/qwen_coder_trees.py
  python -m experiments.report_trees --config=configs/reports/trees.py

A tree's K is its depth (the sweep sets it), so the k axis only spreads the chains.
"""

import ml_collections

from configs import qwen_coder
from configs.sweeps import qwen_coder_batch


def spine(depth: int, siblings: int) -> str:
  """A path list: the draft's first choices `depth` deep, plus its second choice at each of the first
  `siblings` depths (a leaf beside the spine): depth + siblings draft nodes."""
  paths = [[0] * d for d in range(1, depth + 1)] + [[0] * d + [1] for d in range(siblings)]
  return str(paths)


TREES = (  # 14-16 draft nodes each
    "(4, 1, 1, 1)",  # 4 spines of 4: N = 16, D = 4
    "(2, 2, 1, 1)",  # N = 14, D = 4
    "(3, 1, 1, 1, 1)",  # N = 15, D = 5
    "(2, 1, 1, 1, 1, 1, 1, 1)",  # 2 spines of 8: N = 16, D = 8
    spine(10, 6),  # N = 16, D = 10
    "dynamic(16, 6, 4)",  # EAGLE-2: each row's 16 best of 4 + 5 x 16 candidates, depth 6
    "dynamic(16, 8, 2)",  # narrower and deeper: 16 of 2 + 7 x 4
)


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.base = qwen_coder.get_config()  # the real pair; configs/qwen_coder.py documents every field
  cfg.base.k_policy = "fixed"  # K tokens every round: the points measure each K (the default adapts)
  cfg.base.prompts = qwen_coder_batch.PROMPTS  # eight coding prompts
  cfg.base.chat = True  # through the tokenizer's chat template
  cfg.base.max_new_tokens = 128  # budget per prompt
  cfg.base.batch_size = 4  # two batches of 4
  cfg.base.tree_children = "without_replacement"  # at T > 0: distinct children, each p its elders removed
  cfg.axes = ml_collections.ConfigDict()  # decode field -> values; the grid is their cartesian product
  cfg.axes.mode = ("autoregressive", "speculative")  # the baseline once per temperature
  cfg.axes.k = (4, 8, 16)  # the chains' K (a tree's K is its depth)
  cfg.axes.tree = ("",) + TREES  # "" = a chain
  cfg.axes.temperature = (0.0, 1.0)  # greedy and plain sampling
  cfg.output = "experiments/results/sweep_qwen_coder_trees.jsonl"  # JSONL table, one row per point
  cfg.measure_cost = True  # c at batch 4
  cfg.cost_repeats = 5  # timed 1-token forwards per model (the median is kept)
  return cfg
