"""N-gram spines against n-gram chains on real prompts: prompt lookup (no draft model) for the
Qwen2.5-Coder-1.5B-Instruct target on the first 4 input-grounded code edits of
`configs/code_edit_prompts.py` (chat template; the answer repeats most of the prompt), greedy, batch
1, 128 new tokens: chains of K = 4 and 8, and spines `(b, 1, ..., 1)` of depth 8 with b = 2 and 3 (the
b best matches with distinct next tokens, each continued 8 deep), against the target's autoregressive
baseline. About 15 minutes alone on 2 CPU cores. The committed table
(`experiments/results/sweep_qwen_coder_ngram_trees.jsonl`) ran the shorter grid
`--config.base.max_new_tokens=96 --config.axes.k='(8,)'` (14 minutes on a slow host).

  python -m experiments.sweep --config=configs/sweeps/qwen_coder_ngram_trees.py
  python -m experiments.report_trees --config=configs/reports/trees.py:ngram
"""

import ml_collections

from configs import qwen_coder_ngram
from configs.code_edit_prompts import code_edit_prompts


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.base = qwen_coder_ngram.get_config()  # prompt lookup, suffixes of 3-5 tokens (fields: configs/qwen_coder.py)
  cfg.base.k_policy = "fixed"  # K tokens every round: the points measure each K (the default adapts)
  cfg.base.prompts = tuple(code_edit_prompts()[:4])  # whole functions with a local edit to make
  cfg.base.chat = True  # requests, as a user would send them
  cfg.base.max_new_tokens = 128  # budget per prompt
  cfg.base.batch_size = 1  # the latency regime
  cfg.base.temperature = 0.0  # greedy: what a code edit runs at
  cfg.axes = ml_collections.ConfigDict()  # decode field -> values; the grid is their cartesian product
  cfg.axes.mode = ("autoregressive", "speculative")  # the baseline runs once
  cfg.axes.k = (4, 8)  # tokens copied per round at most (chains)
  cfg.axes.tree = ("", "(2, 1, 1, 1, 1, 1, 1, 1)", "(3, 1, 1, 1, 1, 1, 1, 1)")  # chains; 2 and 3 spines of 8
  cfg.output = "experiments/results/sweep_qwen_coder_ngram_trees.jsonl"  # JSONL table, one row per point
  cfg.measure_cost = True  # c (0 for a lookup)
  cfg.cost_repeats = 5  # timed 1-token forwards (the median is kept)
  return cfg
