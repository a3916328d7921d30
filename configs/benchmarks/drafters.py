"""The drafter benchmark (`python -m experiments.benchmark_drafters --config=configs/benchmarks/drafters.py`):
specjax autoregressive decoding against each drafter (n-gram prompt lookup, the 0.5B draft model at fixed
K and with early stopping, the target's own layers) on three prompt sets, plus `transformers` `generate`
and its prompt lookup on the input-grounded set, in one process, one JSON file.

Systems are named per prompt set and regime:
  "ngram"              prompt lookup, K = ngram_k, suffixes of drafters.ngram.min .. max tokens
  "layer_skip"         the target's layers `drafters.layer_skip.layers` draft, K = layer_skip_k (skipped
                       while they are "")
  "model"              the draft model at every K of model_ks, then at threshold_k with every threshold
  "model_k5"           the draft model at K = 5 (any K); "model_k8_t0.5": K = 8, model.stop_threshold 0.5
  ("ngram_k4", "layer_skip_k6": the same with another K.)
  "model_k8_adaptive"  the adaptive K policy (config.k_policy) with K = 8 the most; any drafter
  "model@gemma_k3"     the draft model other_drafts.gemma instead of `draft` (any of the forms above)
  "model+spines"       the draft model drafting the static tree trees.spines, K = its depth (fixed, or
                       "model+spines_adaptive": the policy chooses the depth each round)
Regimes per set: `greedy` (batch 1, T = 0), `sampled` (batch 1, sampled_temperature), `batched`
(batched_size, T = 0) and `batched_large` (large_batch_size, T = 0).
Each (prompt set, batch size, temperature) group runs specjax autoregressive first, again after every
`ar_every` systems and last; speedups divide by the mean of those runs.

Defaults: about 40 minutes alone on 2 CPU cores for the Qwen pair (2 prompts per set, 128 new tokens;
~7 minutes more with drafters.layer_skip.layers set). `--config.sets.chat.num_prompts=4` etc. for more prompts.

`get_config("tiny")`: a small plan for tests on tiny HF directories (pass --config.target and
--config.draft; plain-text prompts, 8 new tokens).
"""

import ml_collections


def prompt_set(chat: bool, num_prompts: int, greedy: tuple, sampled: tuple, batched: tuple,
               batched_large: tuple = ()) -> ml_collections.ConfigDict:
  s = ml_collections.ConfigDict()
  s.chat = chat  # apply the tokenizer's chat template (False for raw text, and for tiny test tokenizers)
  s.num_prompts = num_prompts  # prompts of the set run at batch 1 (batched runs: at least one full batch)
  s.greedy = greedy  # systems run at batch 1, temperature 0 (greedy outputs checked against autoregressive)
  s.sampled = sampled  # systems run at batch 1, temperature `sampled_temperature`
  s.batched = batched  # systems run at batch `batched_size`, temperature 0
  s.batched_large = batched_large  # systems run at batch `large_batch_size`, temperature 0
  return s


def get_config(variant: str = ""):
  cfg = ml_collections.ConfigDict()
  cfg.target = "qwen2.5-coder-1.5b-instruct"  # registry name, .gguf file or HF directory
  cfg.draft = "qwen2.5-coder-0.5b-instruct"  # the model drafter's draft (same tokenizer); "" if no "model"
  # More draft models by alias, for comparing drafts of one target in one run: system "model@ALIAS_k3"
  # drafts with other_drafts.ALIAS (letters, digits, "." and "-"; loaded once, beside the target).
  cfg.other_drafts = ml_collections.ConfigDict()
  # Weight formats of those drafts by alias (config.model.weights: "int8", "int4", "int4:G"; absent: as
  # drafters.model.weights), e.g. other_drafts.q4 = the same 0.5B draft, draft_weights.q4 = "int4".
  cfg.draft_weights = ml_collections.ConfigDict()
  # Draft trees by alias: system "model+ALIAS" drafts the tree trees.ALIAS (K = its depth; a config.tree
  # value: a branching tuple or a path list; letters, digits, "." and "-" in the alias).
  cfg.trees = ml_collections.ConfigDict()
  cfg.dtype = "float32"  # "float32" on CPU
  cfg.max_new_tokens = 128  # budget per prompt (EOS may stop a row earlier)
  cfg.seed = 0  # sampling seed of the temperature > 0 runs
  cfg.model_ks = (5, 8)  # "model": fixed-K runs of the draft model
  cfg.thresholds = (0.3, 0.5, 0.7)  # "model": model.stop_threshold runs, at K = threshold_k
  cfg.threshold_k = 8  # K of the "model" threshold runs
  cfg.ngram_k = 8  # K of "ngram" (tokens copied per round at most)
  # Shortest and longest suffix looked up. 3..5 rather than the library's 1..3: on the chat prompts a
  # 1- or 2-token suffix matches often and wrongly, and every match pays a (K+1)-token verify pass
  # (~2 target steps on this CPU); replaying the greedy outputs of experiments/results/
  # decode_cpu_float32.json gives a modelled 0.83x at 1..3 and 1.01x at 3..5 (K = 8), while copying
  # from an edited function loses almost nothing.
  cfg.drafters = ml_collections.ConfigDict()  # drafter groups of the decode config, as decode takes them
  cfg.drafters.ngram = ml_collections.ConfigDict()
  cfg.drafters.ngram.min = 3
  cfg.drafters.ngram.max = 5  # also transformers' max_matching_ngram_size (it has no minimum)
  # "layer_skip": the target's drafting layers ("" skips layer_skip); the default is the set that
  # experiments/layer_skip_search.py found for the Qwen 1.5B target (21 of 28 layers, alpha_hat 0.87).
  cfg.drafters.layer_skip = ml_collections.ConfigDict()
  cfg.drafters.layer_skip.layers = "0-5,7-8,10-11,14,16-17,19-20,22-27"
  cfg.layer_skip_k = 4  # K of "layer_skip"
  cfg.default_k = 5  # K of any other drafter named without one (a drafter of your own: "mypkg.mod:Class")
  cfg.sampled_temperature = 1.0  # temperature of the sets' `sampled` runs (top-k/top-p off)
  cfg.batched_size = 4  # batch size of the sets' `batched` runs
  cfg.large_batch_size = 8  # batch size of the sets' `batched_large` runs
  cfg.prompt_sets = ("code_edit", "chat", "raw")  # which sets run, in this order
  cfg.continuation_lines = 8  # "raw": lines of each function given as the prompt
  cfg.sets = ml_collections.ConfigDict()
  # Input-grounded: edit a standard-library function and return it whole (configs/code_edit_prompts.py).
  cfg.sets.code_edit = prompt_set(True, 2, greedy=("ngram", "layer_skip"), sampled=(),
                                  batched=("ngram", "model_k5", "layer_skip"))
  # Open-ended coding requests (experiments/benchmark_decode.py PROMPTS).
  cfg.sets.chat = prompt_set(True, 2, greedy=("ngram", "model_k5", "model_k8", "model_k8_t0.5", "layer_skip"),
                             sampled=("model_k8", "model_k8_t0.5"), batched=())
  # Raw continuation of standard-library function sources, no chat template.
  cfg.sets.raw = prompt_set(False, 2, greedy=("model",), sampled=("model_k8", "model_k8_t0.5"), batched=())
  cfg.ar_every = 3  # rerun the autoregressive baseline after this many systems (and always first and last)
  # profile every run (decode's config.profile: a round's time beside its passes; docs/profiling.md)
  cfg.profile = False
  cfg.repeats = 1  # run each group's systems and baselines this many times over (an A/B over the drift)
  cfg.cost_repeats = 5  # timed forwards per cost measurement (c, verify cost); the median is kept
  cfg.transformers = True  # also time transformers generate, plain and with prompt lookup (batch 1, greedy)
  cfg.transformers_set = "code_edit"  # the prompt set transformers runs (same input ids as specjax)
  cfg.output = "experiments/results/drafters_cpu_float32.json"  # rewritten after every measurement
  cfg.report = ""  # a results file to print the tables of, instead of running anything

  if variant == "tiny":
    cfg.target = cfg.draft = "tests-will-override"  # HF directories of a tiny target and draft
    cfg.max_new_tokens = 8
    cfg.model_ks, cfg.thresholds = (2,), ()  # the stop threshold runs with the adaptive policy, below
    cfg.ngram_k, cfg.drafters.ngram.min, cfg.drafters.ngram.max = 3, 1, 2
    cfg.drafters.layer_skip.layers, cfg.layer_skip_k = "0", 2
    cfg.batched_size = 2
    cfg.continuation_lines = 2
    cfg.prompt_sets = ("code_edit", "raw")  # chat, like raw, would only add compile time to the tests
    # One system of each kind the harness treats apart (a lookup, a model at a fixed K, the adaptive policy,
    # a tree, another draft, batched and sampled regimes): every further system is another compile.
    cfg.sets.code_edit = prompt_set(False, 2, greedy=("ngram",), sampled=(), batched=("ngram",))
    cfg.sets.chat = prompt_set(False, 1, greedy=("model_k2_t0.5",), sampled=(), batched=())
    # Tiny models' top probability is ~0.05: 0.06 stops some drafts.
    cfg.sets.raw = prompt_set(False, 2, greedy=("model_k2_t0.06_adaptive", "model+pair_adaptive"),
                              sampled=("model@second_k2",), batched=())
    cfg.trees.pair = "(2, 1)"
    cfg.other_drafts.second = "tests-will-override"  # another tiny draft
    cfg.ar_every = 2
    cfg.cost_repeats = 2
    cfg.output = "tests-will-override"
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/benchmarks/drafters.py (known: 'tiny')")
  return cfg
