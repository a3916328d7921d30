"""What an EAGLE-3 head for Qwen2.5-Coder-1.5B would cost against the 0.5B draft
(`python -m experiments.eagle_qwen_cost --config=configs/benchmarks/eagle_qwen_cost.py`): c at batch 1 and
4, one training step, and the projection of a training run, one JSON file.
"""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.batch = 1  # training rows per timed step (float32 logits of 151,936 ids: ~2 GB per row)
  cfg.repeats = 5  # timed forward pairs per cost ratio c (training steps timed: 2)
  cfg.draft_vocab = 32768  # the restricted head's size (the most frequent standard-library tokens)
  cfg.gpu_tflops = 300.0  # assumed sustained bfloat16 TFLOP/s of one H200 for the estimate (~30% of peak)
  cfg.output = "experiments/results/eagle_qwen_cost_cpu.json"  # the JSON results
  return cfg
