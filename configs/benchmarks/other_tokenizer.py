"""A draft with another tokenizer drafting for the Qwen2.5-Coder-1.5B target through the token-level
intersection, against plain decoding in one run (`python -m experiments.benchmark_drafters
--config=configs/benchmarks/other_tokenizer.py`; fetch `smollm2-135m-instruct` first):

  raw   continuation of standard-library code, no chat template: batch 1 at T = 0 and 1, batch 4 at T = 0
  chat  open-ended coding requests: batch 1 at T = 1, batch 4 at T = 0
Each cell: specjax autoregressive, fixed K = 3 and the adaptive K policy (K <= 8), autoregressive again
after every two systems. 64 new tokens per prompt. About 30 minutes alone on 2 CPU cores.

`get_config("gemma")`: the Gemma-3-270M draft (SentencePiece with byte fallback) instead of SmolLM2-135M.
`get_config("compare")`: the same-tokenizer Qwen2.5-Coder-0.5B draft, SmolLM2-135M and Gemma-3-270M at
K = 3 in every cell (chat at T = 0 and at batch 4 too), one run: 6 groups, about 50 minutes (fetch all three).
"""

from configs.benchmarks import drafters


def get_config(variant: str = ""):
  cfg = drafters.get_config()
  cfg.draft = "smollm2-135m-instruct"  # another tokenizer: drafted through the intersection
  cfg.max_new_tokens = 64
  cfg.model_ks, cfg.thresholds = (3,), ()
  systems = ("model_k3", "model_k8_adaptive")
  cfg.prompt_sets = ("raw", "chat")
  cfg.sets.raw = drafters.prompt_set(False, 2, greedy=systems, sampled=systems, batched=systems)
  cfg.sets.chat = drafters.prompt_set(True, 2, greedy=(), sampled=systems, batched=systems)
  cfg.ar_every = 2
  cfg.transformers = False
  cfg.output = "experiments/results/other_tokenizer/cells_smollm2.json"
  if variant == "gemma":
    cfg.draft = "gemma-3-270m"
    cfg.output = "experiments/results/other_tokenizer/cells_gemma.json"
  elif variant == "compare":
    cfg.draft = "qwen2.5-coder-0.5b-instruct"  # the same tokenizer as the target
    cfg.other_drafts.smollm2, cfg.other_drafts.gemma = "smollm2-135m-instruct", "gemma-3-270m"
    systems = ("model_k3", "model@smollm2_k3", "model@gemma_k3")
    cfg.sets.raw = drafters.prompt_set(False, 2, greedy=systems, sampled=systems, batched=systems)
    cfg.sets.chat = drafters.prompt_set(True, 2, greedy=systems, sampled=systems, batched=systems)
    cfg.output = "experiments/results/other_tokenizer/cells_compare.json"
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/benchmarks/other_tokenizer.py "
                     f"(known: 'gemma', 'compare')")
  return cfg
