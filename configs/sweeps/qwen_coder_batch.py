"""Batch-size sweep on the real pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft): batch 1, 2, 4, 8,
speculative K = 4 vs autoregressive, greedy; 8 chat coding prompts (one full batch of 8), 64 tokens.
About 15 minutes alone on 2 CPU cores.

  python -m experiments.sweep --config=configs/sweeps/qwen_coder_batch.py
  python -m experiments.plots --config=configs/reports/plots.py:qwen_coder_batch
"""

import ml_collections

from configs import qwen_coder
from configs.sweeps import qwen_coder_k

PROMPTS = qwen_coder_k.PROMPTS + (  # 8 prompts, so that every batch size runs full batches
    "Write a Python function that parses a CSV file and returns the average of a numeric column.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts the words in a text file and returns the ten most common.",
    "Write a Python decorator that retries a function up to three times when it raises an exception.",
)


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.base = qwen_coder.get_config()  # the real pair; configs/qwen_coder.py documents every field
  cfg.base.k_policy = "fixed"  # K tokens every round: the points measure each K (the default adapts)
  cfg.base.prompts = PROMPTS  # eight coding prompts
  cfg.base.chat = True  # through the tokenizer's chat template
  cfg.base.max_new_tokens = 64  # budget per prompt
  cfg.base.k = 4  # draft tokens per round
  cfg.base.temperature = 0.0  # greedy: speculative outputs equal the autoregressive ones
  cfg.axes = ml_collections.ConfigDict()  # decode field -> values; the grid is their cartesian product
  cfg.axes.mode = ("autoregressive", "speculative")  # the baseline at every batch size
  cfg.axes.batch_size = (1, 2, 4, 8)  # prompts decoded together
  cfg.output = "experiments/results/sweep_qwen_coder_batch.jsonl"  # JSONL table, one row per point
  cfg.measure_cost = True  # measure c at every batch size (the cost of a pass changes with the batch)
  cfg.cost_repeats = 5  # timed 1-token forwards per model (the median is kept)
  return cfg
