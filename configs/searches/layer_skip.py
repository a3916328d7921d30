"""Skip-set search for the self-speculative (layer-skip) drafter (`python -m experiments.layer_skip_search`).

  python -m experiments.layer_skip_search --config=configs/searches/layer_skip.py:qwen
  python -m experiments.layer_skip_search --config=configs/searches/layer_skip.py:smollm2
"""

import ml_collections

from specjax.decode_config import default_config

CALIBRATION_PROMPTS = (  # chat coding requests, none of them in the benchmarks' prompt sets
    "Write a Python function that removes duplicate items from a list while keeping their order.",
    "Write a Python function that converts a Roman numeral string to an integer.",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "Write a Python function that checks whether two strings are anagrams of each other.",
)
TARGETS = {"qwen": "qwen2.5-coder-1.5b-instruct", "smollm2": "smollm2-135m-instruct"}


def get_config(target="qwen"):
  cfg = ml_collections.ConfigDict()
  cfg.base = default_config()  # the decode config of every evaluation (specjax/decode_config.py)
  cfg.base.k_policy = "fixed"  # K tokens every round: each evaluation measures acceptance at K (the default adapts)
  cfg.base.target = TARGETS[target]  # the model drafting for itself
  cfg.base.drafter = "layer_skip"
  cfg.base.layer_skip.layers = "0"  # a placeholder: each evaluation sets its candidate
  cfg.base.prompts = CALIBRATION_PROMPTS  # calibration prompts, chat-formatted
  cfg.base.max_new_tokens = 48  # tokens per calibration prompt: enough rounds for alpha, cheap
  cfg.base.k = 4  # draft tokens per round during the search
  cfg.base.batch_size = 4  # all calibration prompts in one batch (one compile per candidate)
  cfg.max_evaluations = 16  # candidate skip sets decoded (each compiles once: ~20 s for the 1.5B)
  cfg.cost_repeats = 7  # timed forward pairs for each measured cost ratio
  cfg.output = f"experiments/results/layer_skip_search_{target}.json"  # every evaluation, the best set
  return cfg
