"""Constrained decoding benchmark (`python -m experiments.benchmark_constraints
--config=configs/benchmarks/constraints.py`): JSON-extraction and tool-call requests, each with its JSON
schema (`experiments/benchmark_constraints.py` REQUESTS), decoded unconstrained and constrained by every
system, greedy."""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.target = "qwen2.5-coder-1.5b-instruct"  # registry name, .gguf file or HF directory
  cfg.draft = "qwen2.5-coder-0.5b-instruct"  # the model drafter's draft
  cfg.dtype = "bfloat16"  # half the memory of float32 (the shared 23 GB host); on CPU through the matmul kernel
  cfg.num_requests = 4  # the first N requests of REQUESTS (8 in all)
  cfg.max_new_tokens = 64  # budget per request (EOS, allowed once the schema is matched, may stop earlier)
  cfg.systems = ("autoregressive", "model_k5", "model_adaptive", "ngram")  # "model_kN", "model_adaptive"
  #                                       (K = 5 the most), "ngram" (K = 5), trees: "model_tree", "model_dynamic",
  #                                       "ngram_tree" (experiments/benchmark_constraints.py TREES, depth 5)
  cfg.constrained = (False, True)  # each system runs without and with the requests' schemas
  cfg.mask_batches = (1, 8)  # batch sizes at which the mask's own cost is timed against a round's
  cfg.output = "experiments/results/constraints_cpu_bfloat16.json"
  cfg.report = ""  # a results file: print its tables instead of running
  return cfg
