"""The accelerator run kit (`python -m experiments.benchmark_accelerator --config=configs/benchmarks/accelerator.py`):
the Qwen2.5-Coder pair (1.5B target, 0.5B draft), autoregressive against speculative decoding at every K,
batch size and prompt length of the grid, in bfloat16, one JSON file rewritten after every cell.

  --config.weights=random   random parameters of the pair's exact shapes and random prompt ids: what a
                            lent GPU without the checkpoints can run (timings, c, modelled speedups)
  --config.weights=real     the registry models (`python -m specjax.models fetch ...` beforehand) and
                            standard-library code as prompts: measured alpha and speedups too

First cells: dense, blockwise and kernel attention side by side (autoregressive and K = 5, 128-token
prompts, batch 1), each with its program's lowering report (loops inside the round, kernels).
Default grid: prompts of 128 and 2048 tokens x batch 1, 8, 32 x (autoregressive, K = 3, 5, 8, adaptive K <= 8),
128 new tokens, then at 128 tokens the block drafters (`parallel`, `dflash`, K = 5) per batch size: 36 compiled
programs, plus target forwards of 1-65 tokens at the 128-token prompts. Sized for under 8 minutes on one H200
(estimate in experiments/benchmark_accelerator.py); `deadline_s` skips what would start later, and smaller grids are
one override away (`--config.batch_sizes='(1,8)'`, `--config.ks='(5,)'`).

`get_config("mtbench")`: the real pair (its weights must be on the machine), a 1 x 2 x (1 + 1) grid, then
the MT-Bench cell (`mtbench`).
`get_config("tiny")`: tiny random models in float32 on CPU, a 2 x 1 x (1 + 1 + adaptive) grid after the kernel's two
comparison cells, for the tests.
"""

import ml_collections

from specjax.decode_config import default_config


def get_config(variant: str = ""):
  decode = default_config()
  cfg = ml_collections.ConfigDict()
  cfg.weights = "real"  # "real": load target and draft; "random": random params of the `shapes` pair
  cfg.target = "qwen2.5-coder-1.5b-instruct"  # weights=real: registry name, .gguf file or HF directory
  cfg.draft = "qwen2.5-coder-0.5b-instruct"  # weights=real: the draft (same tokenizer)
  cfg.shapes = "qwen2.5-coder"  # weights=random: a (target, draft) pair of benchmark_accelerator.SHAPES
  cfg.dtype = "bfloat16"  # "bfloat16" on GPU/TPU ("float32" on CPU, where bfloat16 matmuls are ~20x slower)
  cfg.scan_layers = decode.scan_layers  # "auto" | "on" | "off", as in the decode config
  cfg.attention = decode.attention  # the grid's attention: "auto" | "dense" | "blockwise" | "kernel"
  cfg.attention_block = decode.attention_block  # keys per block of blockwise attention (0 = dense)
  cfg.narrow_passes = decode.narrow_passes  # "auto" | "on" | "off", as in the decode config
  # First of all: these attention implementations side by side at the first prompt length, batch 1
  # (autoregressive and K = comparison_k), each program's lowering report beside its timings; () = none.
  cfg.attention_comparison = ("dense", "blockwise", "kernel")
  cfg.comparison_k = 5
  cfg.prefill_chunk = decode.prefill_chunk  # prompt tokens per prefill pass
  cfg.prompt_lengths = (128, 2048)  # every prompt of a cell has exactly this many tokens
  cfg.batch_sizes = (1, 8, 32)  # rows decoded together
  cfg.ks = (3, 5, 8)  # draft tokens per round of the speculative cells (each K compiles its program)
  # The most draft tokens per round of the adaptive cells (k_policy "adaptive": the cost table is measured on
  # the device with the cell's own program before its timed calls); () = none.
  cfg.adaptive_ks = (8,)
  # Drafters proposing the block from one draft pass, timed at the first prompt length, every batch size, K =
  # block_k: "parallel" (the draft model, PARD-style) and "dflash" (a random DFlash head of the target's width).
  cfg.block_drafters = ("parallel", "dflash")
  cfg.block_k = 5
  cfg.max_new_tokens = 128  # tokens generated per row (EOS is ignored: every row runs its whole budget)
  cfg.repeats = 2  # timed prefill (1-token) and whole-budget calls per cell after the warm-up; medians kept
  cfg.cost_repeats = 10  # timed draft/target forward pairs per cost ratio c (the median is kept)
  # Target forwards of T tokens (a verify of a chain of K = T - 1 or of a tree of T - 1 nodes) timed at the
  # first prompt length and every batch size, as multiples of the 1-token step: the premise of the tree
  # cost model ("a verify of <= 64 tokens costs about one step") measured. Must hold 1; () = not timed.
  cfg.verify_widths = (1, 5, 9, 17, 33, 65)
  cfg.seed = 0  # random parameters and prompt ids (weights=random); greedy decoding uses no randomness
  cfg.deadline_s = 390.0  # seconds after the start past which no further cell starts (recorded as skipped)
  # Acceptance rates of the real pair measured on CPU (float32, greedy, batch 1), at which the modelled
  # speedups are computed for every K:
  cfg.modelled_alphas = ml_collections.ConfigDict()
  # alpha_hat at K = 5 on chat-formatted coding requests, full draft head (0.944-0.949 over K = 3..8):
  # experiments/results/decode_cpu_float32.json
  cfg.modelled_alphas.chat_code = 0.947
  # alpha_hat at K = 5 on raw standard-library code continuation (group raw/greedy, system model_k5):
  # experiments/results/drafters_cpu_float32_part2.json
  cfg.modelled_alphas.raw_code = 0.781
  # After the grid (weights=real, before deadline_s): MT-Bench on the pair, configs/benchmarks/mtbench.py:accelerator
  # (1 question per category, both turns, 256 tokens, batch 1 and 8, T = 0 and 1; AR, K = 5, adaptive K <= 8),
  # results in <output>_mtbench.json; the "mtbench" variant shrinks the grid so that both fit 8 minutes.
  cfg.mtbench = False
  cfg.output = "experiments/results/accelerator.json"  # rewritten after every cell
  cfg.report = ""  # a results file to print the table of, instead of running anything

  if variant == "tiny":
    cfg.weights = "random"
    cfg.shapes = "tiny"
    cfg.dtype = "float32"
    cfg.attention_block = 16
    cfg.attention_comparison = ("kernel",)  # in Pallas interpret mode on CPU
    cfg.comparison_k = 2
    cfg.prefill_chunk = 16
    cfg.prompt_lengths = (8, 20)
    cfg.batch_sizes = (2,)
    cfg.ks = (2,)
    cfg.adaptive_ks = (3,)
    cfg.block_k = 2
    cfg.max_new_tokens = 32  # decoding well above the timer's noise on a shared CPU
    cfg.cost_repeats = 2
    cfg.verify_widths = (1, 3, 9)
    cfg.deadline_s = 600.0
    cfg.output = "tests-will-override"
  elif variant == "mtbench":  # the real pair: a small grid, then the MT-Bench cell
    cfg.prompt_lengths, cfg.batch_sizes, cfg.ks, cfg.adaptive_ks, cfg.verify_widths = (128,), (1, 8), (5,), (), ()
    cfg.block_drafters = ()
    cfg.mtbench = True
    cfg.deadline_s = 150.0  # the grid (6 programs) first; MT-Bench (~16 programs) after it
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/benchmarks/accelerator.py (known: 'tiny', 'mtbench')")
  return cfg
