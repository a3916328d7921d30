"""The mesh benchmark (`python -m experiments.benchmark_mesh --config=configs/benchmarks/mesh.py`): the
Qwen2.5-Coder pair on simulated CPU devices: parameter and cache bytes per device, compile time, and
whether a short greedy run gives the single-device tokens, per mesh. Correctness and memory, not speed
(simulated devices share this machine's cores).
"""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.target = "qwen2.5-coder-1.5b-instruct"  # registry name, .gguf file, HF directory or hub name
  cfg.draft = "qwen2.5-coder-0.5b-instruct"  # the draft model (same tokenizer)
  cfg.devices = 8  # simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count) per case
  # Each case: "mesh|mesh_indivisible|draft_sharding"; mesh "" is the single-device baseline.
  cfg.cases = ("|error|same", "model=8|replicate|same", "data=2,model=4|replicate|same",
               "data=2,model=4|error|replicated")
  cfg.batch_size = 8  # rows of the caches whose bytes per device are reported
  cfg.cache_len = 2048  # positions of those caches
  cfg.k = 5  # draft tokens per round of the compiled speculative program
  cfg.run_batch = 2  # rows of the short greedy run (a multiple of every mesh's data axis)
  cfg.run_tokens = 8  # tokens generated per row by the short greedy run (0 = skip it)
  cfg.output = ""  # path of the JSON results (required unless report is set)
  cfg.report = ""  # a results file to print as a table instead of running
  cfg.case = ""  # internal: the one case a subprocess of the benchmark runs ("" = run them all)
  return cfg
