"""K sweep on the real pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft): K = 1..6 and 8 at
temperature 0 and 1, batch 1, with the autoregressive baseline at both temperatures; 2 chat coding
prompts, 128 tokens. About 20 minutes alone on 2 CPU cores (7 compiles of ~35 s, 16 points of ~50 s).

  python -m experiments.sweep --config=configs/sweeps/qwen_coder_k.py
  python -m experiments.plots --config=configs/reports/plots.py:qwen_coder_k
"""

import ml_collections

from configs import qwen_coder

PROMPTS = (  # chat-formatted coding requests (the chat template is applied by the pipeline)
    "Write a Python function that checks whether a string is a palindrome, with a docstring and tests.",
    "Implement binary search over a sorted list in Python and explain its complexity.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
)


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.base = qwen_coder.get_config()  # the real pair; configs/qwen_coder.py documents every field
  cfg.base.k_policy = "fixed"  # K tokens every round: the points measure each K (the default adapts)
  cfg.base.prompts = PROMPTS[:2]  # two coding prompts
  cfg.base.chat = True  # through the tokenizer's chat template
  cfg.base.max_new_tokens = 128  # budget per prompt
  cfg.base.batch_size = 1  # one prompt at a time: the latency regime of speculative decoding
  cfg.axes = ml_collections.ConfigDict()  # decode field -> values; the grid is their cartesian product
  cfg.axes.mode = ("autoregressive", "speculative")  # the baseline runs once per temperature
  cfg.axes.k = (1, 2, 3, 4, 5, 6, 8)  # draft tokens per round
  cfg.axes.temperature = (0.0, 1.0)  # greedy and plain sampling
  cfg.output = "experiments/results/sweep_qwen_coder_k.jsonl"  # JSONL table, one row per point
  cfg.measure_cost = True  # measure the draft/target cost ratio c (batch 1) for the theoretical speedup
  cfg.cost_repeats = 5  # timed 1-token forwards per model (the median is kept)
  return cfg
