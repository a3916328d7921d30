"""The scaling benchmark (`python -m experiments.benchmark_scaling --config=configs/benchmarks/scaling.py`):
what long caches, long prompts and deep models cost (decode step at S_max 1k vs 32k, long-prompt prefill
memory, compile time against depth, the autoregressive loop's step), each case in a fresh subprocess, one JSON file.
"""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.parts = ("decode", "loop", "prefill", "compile")  # which parts run: any of these four
  cfg.repeats = 15  # decode: timed steps per case (the median ratio of back-to-back pairs is kept)
  cfg.loop_repeats = 2  # loop: timings per length (the best is kept)
  cfg.output = "experiments/results/scaling_cpu.json"  # the JSON results ("" = print only)
  cfg.child = ""  # internal: the one call ("function(arg, ...)") a subprocess of the benchmark runs
  return cfg
