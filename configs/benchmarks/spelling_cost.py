"""What reading the text spelled per target token costs a draft with another tokenizer, against
re-tokenizing it (`python -m experiments.spelling_cost --config=configs/benchmarks/spelling_cost.py`)."""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.target = "qwen2.5-coder-1.5b-instruct"  # only its tokenizer is used (the outputs are in `source`)
  cfg.draft = "smollm2-135m-instruct"  # the draft with another tokenizer
  cfg.source = "experiments/results/other_tokenizer/3_smollm2_k5.json"  # decode results: the target's outputs
  cfg.chat = True  # the prompts went through the target's chat template
  cfg.positions_per_output = 128  # generated positions scored per output
  cfg.max_spelling = 4  # M, as the drafter's MAX_SPELLING
  cfg.width = 512  # the draft's forward width (longest history in draft ids)
  cfg.output = "experiments/results/other_tokenizer/spelling_cost_smollm2.json"  # JSON results ("" = print only)
  return cfg
