"""MT-Bench (`python -m experiments.mtbench --config=configs/benchmarks/mtbench.py`; fetch the questions
first: `python -m specjax.data fetch mt-bench`).

Variants (`--config=configs/benchmarks/mtbench.py:NAME`):
  ""            the Qwen2.5-Coder pair on a CPU, shrunk to about an hour on 2 cores: 1 question per
                category (8 questions, 2 turns each), 64 new tokens per turn, greedy; batch 1 (AR, the draft
                model at K = 5 and adaptive, n-gram) and batch 8 (all 8 questions in one batch: AR, K = 5,
                adaptive); transformers generate, assisted and prompt lookup. Sampling and self-speculation
                are one override each (--config.temperatures='(0.0,1.0)', add "layer_skip" to systems):
                each adds ~30-40 minutes on a 2-core host where the target decodes at ~3 tokens/s
  "smollm2"     SmolLM2-135M-Instruct with its EAGLE-3-style head (experiments/distill_eagle_smollm2/head,
                trained by configs/distill_eagle_smollm2.py) and n-gram lookup
  "full"        the whole benchmark as the papers run it (80 questions x 2 turns x 512 tokens, bfloat16):
                an accelerator's run
  "accelerator" the accelerator run kit's MT-Bench cell: 8 questions x 2 turns x 256 tokens, bfloat16,
                batch 1 and 8, T = 0 and 1, the draft model at K = 5 and adaptive
  "tiny"        a small plan for tests on tiny HF directories (pass --config.target and --config.draft)

System names as in configs/benchmarks/drafters.py: "model_k5", "model_k8_adaptive" (the adaptive K
policy, K = 8 the most), "ngram" (K = ngram_k), "layer_skip" (K = layer_skip_k), "eagle_k4", or
"package.module:Class" with a K.
"""

import ml_collections

from configs.benchmarks import drafters


def get_config(variant: str = ""):
  cfg = ml_collections.ConfigDict()
  cfg.target = "qwen2.5-coder-1.5b-instruct"  # registry name, .gguf file or HF directory
  cfg.draft = "qwen2.5-coder-0.5b-instruct"  # the model drafter's draft, or an EAGLE head's directory
  cfg.dtype = "float32"  # "float32" on CPU, "bfloat16" on GPU/TPU
  cfg.questions = "mt-bench"  # the dataset, or a .jsonl of questions in its format (all of them run)
  cfg.categories = ()  # MT-Bench categories to run, in this order; () = all 8
  cfg.questions_per_category = 1  # the first N questions of each category (10 = the whole benchmark)
  cfg.max_new_tokens = 64  # budget per turn (EOS may stop earlier); the papers use 512 (1024 for some)
  cfg.seed = 0  # sampling seed of the temperature > 0 runs
  cfg.temperatures = (0.0,)  # every batch size runs at each (top-k and top-p off); the papers add 1.0
  cfg.batch_sizes = (1, 8)  # specjax batch sizes; per-category speed is measured at batch 1 only
  cfg.systems = ("model_k5", "model_k8_adaptive", "ngram")  # at batch 1 ("layer_skip": 0.63-0.99x elsewhere)
  cfg.batched_systems = ("model_k5", "model_k8_adaptive")  # at batch sizes > 1
  cfg.ar_every = 4  # rerun the autoregressive baseline after this many systems (and first and last)
  cfg.profile = False  # profile every run (decode's config.profile: a round's time beside its passes)
  # What parse_systems and the decode configs read (configs/benchmarks/drafters.py explains each).
  base = drafters.get_config()
  cfg.model_ks, cfg.thresholds, cfg.threshold_k = base.model_ks, (), base.threshold_k
  cfg.ngram_k, cfg.layer_skip_k, cfg.default_k = base.ngram_k, base.layer_skip_k, base.default_k
  cfg.drafters = base.drafters  # ngram min/max 3..5, layer_skip's layers (found for the Qwen 1.5B target)
  cfg.transformers = ("generate", "assisted", "prompt_lookup")  # transformers systems (batch 1); () = none
  cfg.transformers_temperatures = (0.0,)  # temperatures the transformers systems run at (among temperatures)
  cfg.output = "experiments/results/mtbench_qwen_cpu.json"  # rewritten after every run; resumed if present
  cfg.figure = "experiments/results/plots/mtbench_qwen_cpu.png"  # speedup and τ per category; "" = none
  cfg.report = ""  # a results file to print the tables of (and draw `figure` from), instead of running

  if variant == "smollm2":
    cfg.target = "smollm2-135m-instruct"
    cfg.draft = "experiments/distill_eagle_smollm2/head"
    # layer_skip: the best set experiments/layer_skip_search.py found for SmolLM2 models 0.48x (alpha 0.63
    # at c 0.80): no run. The model drafter: no smaller SmolLM2 here.
    cfg.systems = ("eagle_k4", "eagle_k4_adaptive", "ngram")
    cfg.batched_systems = ("eagle_k4", "ngram")
    cfg.temperatures = (0.0,)  # this CPU runs SmolLM2 at ~5-6 tokens/s (per-step overhead): greedy only
    cfg.transformers = ("generate", "prompt_lookup")
    cfg.output = "experiments/results/mtbench_smollm2_cpu.json"
    cfg.figure = "experiments/results/plots/mtbench_smollm2_cpu.png"
  elif variant == "full":
    cfg.dtype = "bfloat16"
    cfg.temperatures = (0.0, 1.0)
    cfg.systems = ("model_k5", "model_k8_adaptive", "ngram", "layer_skip")
    cfg.questions_per_category = 10
    cfg.max_new_tokens = 512
    cfg.transformers = ()
    cfg.output = "experiments/results/mtbench_qwen_accelerator.json"
    cfg.figure = "experiments/results/plots/mtbench_qwen_accelerator.png"
  elif variant == "accelerator":  # the accelerator run kit's MT-Bench cell (configs/benchmarks/accelerator.py)
    cfg.dtype = "bfloat16"
    cfg.temperatures = (0.0, 1.0)
    cfg.max_new_tokens = 256
    cfg.systems = cfg.batched_systems = ("model_k5", "model_k8_adaptive")
    cfg.transformers = ()
    cfg.output = "experiments/results/accelerator_mtbench.json"
    cfg.figure = "experiments/results/accelerator_mtbench.png"
  elif variant == "tiny":
    cfg.target = cfg.draft = "tests-will-override"  # HF directories of a tiny target and draft
    cfg.questions = "tests-will-override"  # a .jsonl of MT-Bench-style questions
    cfg.max_new_tokens = 6
    cfg.temperatures = (0.0, 1.0)
    cfg.batch_sizes = (1, 2)
    cfg.systems = ("model_k2", "ngram_k2")
    cfg.batched_systems = ("ngram_k2",)  # the adaptive policy's calibration is the drafters benchmark's test
    cfg.drafters.ngram.min, cfg.drafters.ngram.max = 1, 2
    cfg.drafters.layer_skip.layers = "0"
    cfg.transformers = ("generate",)
    cfg.output = cfg.figure = "tests-will-override"
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/benchmarks/mtbench.py (known: 'smollm2', 'full', "
                     f"'accelerator', 'tiny')")
  return cfg
