"""The suffix-decoding benchmark (`python -m experiments.benchmark_suffix --config=configs/benchmarks/suffix.py`):
four workloads where earlier text recurs, specjax autoregressive against n-gram lookup and suffix decoding with
and without its pool, on the default target in float32; the suffix drafter's own cost per pool size; transformers'
prompt lookup as the peer. `:tiny` runs the same machinery on the tiny test models (a smoke run).
"""

import ml_collections

from specjax.speculative.drafters.suffix import SuffixDrafter


def get_config(variant: str = ""):
  cfg = ml_collections.ConfigDict()
  cfg.target = "qwen2.5-coder-1.5b-instruct"  # the target (no draft model: every system is model-free)
  cfg.dtype = "float32"
  cfg.max_new_tokens = 64  # budget per request
  cfg.seed = 0
  cfg.chat = True  # prompts through the target's chat template (MT-Bench turns need it)
  cfg.k = 8  # the most draft tokens a round proposes (n-gram and suffix alike)
  cfg.ngram = ml_collections.ConfigDict({"min": 1, "max": 3})  # the n-gram drafter's group
  cfg.suffix = SuffixDrafter.config_group()  # the suffix drafter's group (its pool_tokens: the pool systems')
  cfg.workloads = ("repeated_task", "mtbench_turn2", "code_edit", "self_consistency")  # run in this order
  cfg.systems = ("ngram", "suffix_no_pool", "suffix_pool", "suffix_pool_adaptive")  # experiments.benchmark_suffix
  cfg.ar_every = 2  # autoregressive runs first, after every this many systems and last
  cfg.repeated_task = ml_collections.ConfigDict({
      "module": "shutil",  # the stdlib module whose functions the one instruction is applied to
      "requests": 5,  # its first functions of 6-40 lines, decoded one after another
      "from_request": 3
  })  # tokens/s and acceptance counted from this request on (the pool holds the earlier ones)
  # MT-Bench conversations (`python -m specjax.data fetch mt-bench`): the first of each of these categories
  cfg.mtbench_categories = "writing,roleplay,extraction,coding"
  cfg.code_edit_requests = 3  # the first code edits of configs/code_edit_prompts.py
  cfg.self_consistency = ml_collections.ConfigDict({
      "prompt": "Write a Python function that returns the n-th Fibonacci number, with a short explanation.",
      "samples": 8,  # copies of the prompt in one batch
      "temperature": 0.7
  })
  cfg.pool_sizes = (16_384, 262_144, 1_048_576)  # pools timed for the drafter's own cost (() = none)
  cfg.cost_history = 512  # history tokens per row when timing the drafter
  cfg.cost_repeats = 20
  cfg.transformers = True  # transformers generate and prompt lookup on the greedy batch-1 workloads
  cfg.output = "experiments/results/suffix_cpu_float32.json"  # the JSON results ("" = print only)
  cfg.report = ""  # a results file: print its tables instead of running
  if variant == "tiny":  # needs the tiny pair: python -m tests.helpers.tiny_pair /tmp/specjax-tiny
    cfg.target = "/tmp/specjax-tiny/target"
    cfg.max_new_tokens = 12
    cfg.chat = False  # the tiny tokenizer has no chat template
    cfg.workloads = ("repeated_task", "self_consistency")
    cfg.repeated_task.requests = 3
    cfg.self_consistency.samples = 2
    cfg.pool_sizes = (4096,)
    cfg.cost_history = 32
    cfg.cost_repeats = 2
    cfg.transformers = False
    cfg.output = ""
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/benchmarks/suffix.py (known: 'tiny')")
  return cfg
