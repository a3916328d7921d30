"""Every field of a decode config (`python -m specjax.decode`, `experiments.sweep`), with its default and
meaning; configs/*.py start from `default_config()` and override what their experiment needs.

No field is `None`: placeholders are typed ("" for paths), so `--config.FIELD=VALUE` overrides parse and
`lock_config` rejects misspelt fields.
"""

from __future__ import annotations

import ml_collections

from specjax.speculative.drafters import registry


def default_config() -> ml_collections.ConfigDict:
  """Every field with its default, section by section, in the order `to_json` lists them."""
  c = ml_collections.ConfigDict()
  for section in (_model_and_drafter, _prompts, _k_policy, _sampling, _execution, _outputs, _drafter_groups):
    section(c)
  return c


def _model_and_drafter(c: ml_collections.ConfigDict) -> None:
  """What decodes: the target, the mode, the drafter and the draft shape (chain or tree)."""
  c.target = ""  # .gguf file, HF directory, registry name or hub name org/name[@revision] (required)
  c.mode = "speculative"  # "speculative" or "autoregressive" (the target alone: the baseline)
  c.drafter = "model"  # what proposes the draft tokens: "model" | "ngram" | "layer_skip" | "eagle" | "quantized"
  #                     (the target's own weights re-quantized: config.quantized.weights), or the
  #                     import path "package.module:ClassName" of a Drafter subclass (see docs/writing-a-drafter.md)
  c.draft = ""  # drafter "model": the draft model (as target; same tokenizer, head may be padded);
  #               drafter "eagle": the head's directory (specjax's or EAGLE-3's layout)
  c.tree = ""  # drafters "model", "eagle": draft a static tree each round, "(4,2,2,1)" (children per node at
  #              each depth) or a path list "[[0],[1],[0,0]]", or a dynamic (EAGLE-2) tree per row and round,
  #              "dynamic(16,6,4)" (N nodes, depth D, b children per expanded node); drafter "ngram": spines
  #              "(b,1,...,1)"; "" = a chain of k tokens (with a tree, k is its depth)
  c.tree_children = "iid"  # a static tree's children at T > 0: "iid" draws, "without_replacement", or the
  #                          "top" tokens (point masses); greedy, and dynamic trees, always take the top tokens


def _prompts(c: ml_collections.ConfigDict) -> None:
  """What is decoded: the prompts and their budget."""
  c.prompts = ("Write a Python function that checks whether a string is a palindrome.",)  # a tuple
  c.prompts_file = ""  # one prompt per line, or .jsonl with a "prompt" field; overrides prompts
  c.chat = True  # wrap each prompt in the tokenizer's chat template
  c.max_new_tokens = 128  # budget per prompt (EOS may stop a row earlier)


def _k_policy(c: ml_collections.ConfigDict) -> None:
  """How many draft tokens a round proposes: k, the K policy and the adaptive policy's settings."""
  c.k = 5  # draft tokens proposed per round (the most a round can propose)
  c.k_policy = "auto"  # how many of the k tokens a round proposes: "fixed" (all k), "adaptive" (per round,
  #                      the length with the most expected tokens per second: 0 = a plain target step;
  #                      a static tree's depth, whole or its spine; see docs/k-policy.md) or
  #                      "auto": adaptive, but fixed for a dynamic tree
  c.adaptive = ml_collections.ConfigDict()  # the adaptive policy's settings (`specjax.speculative.k_policy`)
  c.adaptive.prior = 0.8  # acceptance estimate of a draft position before any observation, in (0, 1)
  c.adaptive.decay = 0.9  # weight of the old estimate when a round reaches the position, in [0, 1); 0.9
  #                         kept the policy within 0.94-1.01x of the best fixed length on simulated
  #                         acceptance (experiments/simulate_k_policy.py), 0.8 within 0.96-1.00x but
  #                         choosing plain steps in 27% of the rounds at alpha 0.88
  c.adaptive.recovery = 0.02  # drift back toward the prior per round a position is not reached, in [0, 1]
  c.adaptive.calibration_rounds = 3  # rounds first timed (more when they last under 0.5 s) of the plain and the longest
  #                                     candidate when pricing the cost table (docs/k-policy.md, "The cost table")
  c.adaptive.reuse_costs = True  # reuse the cost table this machine measured for the same program (kept in
  #                                $SPECJAX_CACHE/cost_tables); False measures it again and replaces it


def _sampling(c: ml_collections.ConfigDict) -> None:
  """How tokens are drawn: a structured-output constraint and the sampling knobs."""
  c.constraint = ""  # structured output: "regex:PATTERN", or "json_schema:SCHEMA" (inline JSON or a .json file):
  #                    target and draft are masked to tokens that keep the output a prefix of a match, EOS only
  #                    once it matches (see docs/constraints.md); from Python also a dict ({"regex": ...},
  #                    {"json_schema": {...}}); a prompts_file .jsonl record's or a `specjax.Request`'s own
  #                    "constraint" overrides it for that prompt; "" = unconstrained. Chains and trees
  c.temperature = 0.0  # 0 = greedy (output equals the target's own greedy output); these three are every
  #                      prompt's but one whose .jsonl record or `specjax.Request` gives its own
  c.top_k = 0  # 0 disables top-k
  c.top_p = 1.0  # 1 disables top-p
  c.seed = 0  # PRNG seed for sampling


def _execution(c: ml_collections.ConfigDict) -> None:
  """How the program runs: batch, precision, weight format, layers, attention, matmuls, passes and
  devices."""
  c.batch_size = 1  # prompts decoded together; each row accepts its own number of tokens
  c.dtype = "float32"  # "float32", "bfloat16" (half the bytes; on CPU through the matmul kernel, below) or
  #                     "auto": bfloat16 where it runs fast (GPU, TPU, a CPU the kernel runs it on), else float32
  c.weights = "float"  # the target's weight format, quantized from the loaded weights at load (see
  #                      docs/quantized-drafts.md): "float" (config.dtype), "int8" (per output channel,
  #                      float32 scales), "int4" (groups of 32 inputs, bfloat16 scales), "int4:G" (G even,
  #                      32..128, dividing every input width), or "int4a8" / "int4a8:G" (int4's weights, x
  #                      quantized to int8 per group at run time: integer dot products, a draft format);
  #                      a draft model's is config.model.weights.
  #                      Quantized weights multiply through the CPU matmul kernel where it runs
  #                      vectorised (matmul "auto"), else on XLA; no mesh yet
  c.scan_layers = "auto"  # "on": layers stacked and run by lax.scan (compile time flat in depth);
  #                         "off": unrolled; "auto": on for GPU/TPU, off on CPU (see docs/devices.md)
  c.attention = "auto"  # "dense", "blockwise" (live blocks, a loop per layer), "kernel" (Pallas GPU kernel;
  #                       interpret mode on CPU) or "auto": kernel on GPU, blockwise on CPU/TPU (see docs/devices.md)
  c.attention_block = 256  # keys per block of blockwise attention (0 = dense over the cache)
  c.matmul = "auto"  # weight matmuls: "xla", "cpu_kernel" (specjax's CPU kernel, AVX-512 or AVX2: float32, bfloat16,
  #                    int8, int4) or "auto": the kernel for bfloat16 on a CPU with AVX512_BF16 or AVX2+FMA and
  #                    for quantized weights on one with AVX2+FMA, XLA elsewhere
  c.narrow_passes = "auto"  # "on": a verify / catch-up pass runs its narrowest compiled width that fits (a
  #                           branch); "off": always the widest; "auto": off on GPU, on elsewhere
  c.prefill_chunk = 512  # prompt tokens per prefill pass (peak memory ~ chunk x live keys)
  c.mesh = ""  # devices as "data=2,model=4" (batch rows over data, weights' heads/MLP/vocabulary over
  #              model; -1 = the remaining devices); "" = one device (see docs/devices.md, "Several devices")
  c.mesh_indivisible = "error"  # a weight axis (heads, MLP, vocabulary) that does not split over its mesh
  #                               axis: "error", or "replicate" it on every device
  c.draft_sharding = "same"  # the draft model's weights: "same" rules as the target, or "replicated"


def _outputs(c: ml_collections.ConfigDict) -> None:
  """What a run writes and reports besides decoding (or instead of it)."""
  c.output = ""  # path of a JSON results file; empty = print only
  c.profile = False  # also time each batch's prefill and, after the run, every pass alone: where a round's time
  #                    goes (stats["profile"], printed; `specjax.round_profile`, docs/profiling.md)
  c.lower_only = ""  # "cuda", "rocm", "tpu" or "cpu": lower the decode program for that platform and report
  #                    its loops, kernels and host transfers (`specjax.lowering`) instead of running; no such
  #                    device needed; "" = decode


def _drafter_groups(c: ml_collections.ConfigDict) -> None:
  """Each registered drafter's own settings, config.<drafter>.<field> (its class declares them:
  `Drafter.config_group`); a drafter given as package.module:Class brings its group along."""
  for name, drafter in registry.builtin().items():
    c[name] = drafter.config_group()


# Fields that moved into a drafter's group: an old name fails with one line naming the new one.
RENAMED = {
    "ngram_min": "ngram.min", "ngram_max": "ngram.max", "draft_layers": "layer_skip.layers",
    "draft_stop_threshold": "model.stop_threshold", "draft_vocab": "model.vocab (or eagle.vocab)",
    "draft_vocab_corpus": "model.vocab_corpus (or eagle.vocab_corpus)"
}


def moved(path: str) -> str | None:
  """The one-line error for a field that moved into a group (None for any other name)."""
  return f"config.{path} is now config.{RENAMED[path]}" if path in RENAMED else None
