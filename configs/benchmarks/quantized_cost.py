"""Quantized weights through the CPU kernel (`python -m experiments.quantized_cost
--config=configs/benchmarks/quantized_cost.py`): the Qwen draft and target MLP matmuls and whole passes
of the 0.5B draft in bfloat16, int8 and int4, one JSON file.
"""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.formats = ("float", "int8", "int4")  # weight formats (quantized.parse; "float" = bfloat16)
  cfg.tokens = (1, 6)  # token rows per matmul and per pass (1: a decode step; 6: a K = 5 verify pass)
  cfg.matmul_repeats = 60  # interleaved rounds per matmul shape and T (0 = skip the matmuls)
  cfg.stream_bytes = 48 * 2**20  # each matmul cycles copies of its weight whose int4 total exceeds this
  cfg.xla_reference = "int4"  # a format also timed on XLA's path at T = 1 ("" = none)
  cfg.model = "qwen2.5-coder-0.5b-instruct"  # the model whose passes are timed (a registry name or a path)
  cfg.pass_repeats = 15  # interleaved rounds per T of the whole-model passes (0 = skip them)
  cfg.offset = 100  # cached positions each pass attends to
  cfg.output = "experiments/results/quantized_cost_cpu.json"  # the JSON results ("" = print only)
  return cfg
