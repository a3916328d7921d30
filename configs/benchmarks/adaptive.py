"""The adaptive K policy against plain decoding and every fixed K, on the Qwen pair, in one run, one JSON
file (`python -m experiments.benchmark_drafters --config=configs/benchmarks/adaptive.py`):

  raw        continuation of standard-library code, no chat template: the model draft, batch 1 (T = 0
             and 1) and 4 (T = 0)
  chat       open-ended coding requests: the model draft, batch 1 (T = 0 and 1), 4 and 8 (T = 0)
  code_edit  edit a function and return it whole: n-gram lookup, batch 1 and 4 (T = 0)
Each group: specjax autoregressive, K = 1, 3, 5, 8 fixed and K <= 8 adaptive (the policy measures its
cost table on this machine before the group's first timed batch), autoregressive again after every
three systems and last. About 70 minutes alone on 2 CPU cores.

`get_config("trees")`: static trees of the model draft, fixed against the adaptive depth (the tree cut at
the chosen depth each round), the spines (3, 1, 1, 1, 1) and (2, 1, 1, 1, 1, 1, 1, 1) of the trees sweep
(configs/sweeps/qwen_coder_trees.py) on raw code and chat requests at batch 1 and chat requests at
batch 4, greedy; about 40 minutes (the adaptive rounds choose the depth and the width: the spine or the
whole cut).

`get_config("tree_widths")`: the tree (3, 1, 1, 1, 1) fixed and adaptive (depth and width: the cut or its
spine each round) against the chain of its spine, K <= 5 adaptive, on the same three cells; about 35
minutes.

`get_config("kernel_readme")`, `get_config("kernel_mtbench")`: bfloat16 through the CPU matmul kernel
(`specjax.models.matmul`), batch 1, greedy: the README's two prompts, or MT-Bench first turns (one per
category, the first four), with the model draft at K <= 5 adaptive and K = 5 fixed, against specjax's own
autoregressive decoding and transformers (bfloat16: generate, prompt lookup, assisted generation with the
same draft, K = 5) in the same run; about 15 minutes each.

`get_config("sets")`: every prompt set at batch 1, greedy, bfloat16 through the CPU kernel: the README's two
prompts, MT-Bench first turns (one per category, the first four) and raw code, with autoregressive
decoding and the 0.5B draft in bfloat16, in int4 (`other_drafts.q4`, `draft_weights.q4`) and in int4a8 (int4
weights, int8 activations: `q4a8`), each at K = 5 fixed and K <= 5 adaptive, every run profiled
(`config.profile`: a round beside its passes); about 45 minutes on 2 cores.

`get_config("batch1")`: the batch-1 groups of raw code and chat requests only (greedy and T = 1), where the
policy's estimator settings matter most; about 30-45 minutes. `get_config("batched")`: the other groups
(raw code at batch 4, chat requests at batch 4 and 8, code edits); about 45 minutes. `get_config("plain_ab")`:
raw code at batch 1, greedy, where the policy decodes every round plainly: adaptive and autoregressive
alternating six times (the A/B that bounds what the adaptive loop costs over plain decoding); ~25 minutes.
"""

from configs.benchmarks import drafters


def get_config(variant: str = ""):
  cfg = drafters.get_config()
  cfg.max_new_tokens = 64  # budget per prompt
  cfg.model_ks = (1, 3, 5, 8)  # "model": every fixed K the adaptive policy is compared with
  cfg.thresholds = ()  # no early-stopping runs: the policy is the subject
  model = ("model", "model_k8_adaptive")
  ngram = ("ngram_k1", "ngram_k3", "ngram_k5", "ngram_k8", "ngram_k8_adaptive")
  cfg.prompt_sets = ("raw", "chat", "code_edit")  # the losing cells first
  cfg.sets.raw = drafters.prompt_set(False, 2, greedy=model, sampled=model, batched=model)
  cfg.sets.chat = drafters.prompt_set(True, 2, greedy=model, sampled=model, batched=model, batched_large=model)
  cfg.sets.code_edit = drafters.prompt_set(True, 2, greedy=ngram, sampled=(), batched=ngram)
  cfg.transformers = False  # the peer is measured by configs/benchmarks/drafters.py
  cfg.output = "experiments/results/adaptive_cpu_float32.json"
  if variant == "batch1":
    cfg.prompt_sets = ("raw", "chat")
    cfg.sets.raw.batched = cfg.sets.chat.batched = cfg.sets.chat.batched_large = ()
    cfg.output = "experiments/results/adaptive_cpu_float32_batch1.json"
  elif variant == "batched":
    cfg.sets.raw.greedy = cfg.sets.raw.sampled = cfg.sets.chat.greedy = cfg.sets.chat.sampled = ()
    cfg.output = "experiments/results/adaptive_cpu_float32_batched.json"
  elif variant == "plain_ab":
    cfg.prompt_sets = ("raw",)
    cfg.sets.raw = drafters.prompt_set(False, 2, greedy=("model_k8_adaptive",), sampled=(), batched=())
    cfg.ar_every, cfg.repeats = 1, 6
    cfg.output = "experiments/results/adaptive_cpu_float32_plain_ab.json"
  elif variant == "trees":
    cfg.trees.spines5 = "(3, 1, 1, 1, 1)"  # N = 15, depth 5
    cfg.trees.spines8 = "(2, 1, 1, 1, 1, 1, 1, 1)"  # N = 16, depth 8
    trees = ("model+spines5", "model+spines5_adaptive", "model+spines8", "model+spines8_adaptive")
    cfg.prompt_sets = ("raw", "chat")
    cfg.sets.raw = drafters.prompt_set(False, 2, greedy=trees, sampled=(), batched=())
    cfg.sets.chat = drafters.prompt_set(True, 2, greedy=trees, sampled=(), batched=trees)
    cfg.ar_every = 2
    cfg.output = "experiments/results/adaptive_cpu_float32_trees.json"
  elif variant == "tree_widths":
    cfg.trees.spines5 = "(3, 1, 1, 1, 1)"
    systems = ("model+spines5", "model+spines5_adaptive", "model_k5_adaptive")
    cfg.prompt_sets = ("raw", "chat")
    cfg.sets.raw = drafters.prompt_set(False, 2, greedy=systems, sampled=(), batched=())
    cfg.sets.chat = drafters.prompt_set(True, 2, greedy=systems, sampled=(), batched=systems)
    cfg.ar_every = 3
    cfg.output = "experiments/results/adaptive_cpu_float32_tree_widths.json"
  elif variant in ("kernel_readme", "kernel_mtbench"):
    name = variant.removeprefix("kernel_")
    cfg.dtype = "bfloat16"
    cfg.prompt_sets = (name,)
    cfg.sets[name] = drafters.prompt_set(True, 2 if name == "readme" else 4, greedy=("model_k5_adaptive", "model_k5"),
                                         sampled=(), batched=())
    cfg.transformers, cfg.transformers_set = True, name
    cfg.output = f"experiments/results/kernel_cpu_bfloat16_{name}.json"
  elif variant == "sets":
    # Every prompt set at batch 1, greedy, bfloat16 through the CPU kernel (AVX-512 or AVX2+FMA): autoregressive,
    # the bfloat16 draft and the same draft's int4 and int4a8 weights (other_drafts.q4, .q4a8), each at K = 5 fixed
    # and K <= 5 adaptive, every run profiled (a round beside its passes).
    systems = ("model_k5", "model_k5_adaptive", "model@q4_k5", "model@q4_k5_adaptive", "model@q4a8_k5",
               "model@q4a8_k5_adaptive")
    cfg.other_drafts.q4, cfg.draft_weights.q4 = cfg.draft, "int4"
    cfg.other_drafts.q4a8, cfg.draft_weights.q4a8 = cfg.draft, "int4a8"
    cfg.dtype = "bfloat16"
    cfg.model_ks = (5,)
    cfg.prompt_sets = ("readme", "mtbench", "raw")
    cfg.sets.readme = drafters.prompt_set(True, 2, greedy=systems, sampled=(), batched=())
    cfg.sets.mtbench = drafters.prompt_set(True, 4, greedy=systems, sampled=(), batched=())
    cfg.sets.raw = drafters.prompt_set(False, 2, greedy=systems, sampled=(), batched=())
    cfg.ar_every, cfg.profile = 2, True
    cfg.output = "experiments/results/adaptive_cpu_bfloat16_sets.json"
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/benchmarks/adaptive.py "
                     f"(known: 'batch1', 'batched', 'plain_ab', 'trees', 'tree_widths', 'kernel_readme', "
                     f"'kernel_mtbench', 'sets')")
  return cfg
