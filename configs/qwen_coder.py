"""Speculative decoding on the default real pair: Qwen2.5-Coder-1.5B-Instruct (target) drafted by
Qwen2.5-Coder-0.5B-Instruct, both from the registry (`python -m specjax.models fetch NAME`)."""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.target = "qwen2.5-coder-1.5b-instruct"  # registry name, .gguf file or HF directory
  cfg.draft = "qwen2.5-coder-0.5b-instruct"  # same kinds; must share the target's tokenizer
  cfg.mode = "speculative"  # "speculative" or "autoregressive" (target alone, the baseline)
  cfg.prompts = (  # a tuple (overridable: --config.prompts='("a", "b")'); used unless prompts_file
      "Write a Python function that checks whether a string is a palindrome.",
      "Write a Python function that returns the n-th Fibonacci number iteratively.",
  )
  cfg.prompts_file = ""  # one prompt per line, or .jsonl with a "prompt" field; overrides prompts
  cfg.chat = True  # wrap each prompt in the tokenizer's chat template
  cfg.max_new_tokens = 128  # budget per prompt (EOS may stop a row earlier)
  cfg.k = 5  # draft tokens proposed per round
  cfg.draft_vocab = 0  # > 0: the draft's head scores only this many most frequent tokens (0 = all)
  cfg.draft_vocab_corpus = "stdlib"  # corpus ranking them: "stdlib", a directory, glob, text or JSONL
  cfg.temperature = 0.0  # 0 = greedy (output equals the target's own greedy output)
  cfg.top_k = 0  # 0 disables top-k
  cfg.top_p = 1.0  # 1 disables top-p
  cfg.seed = 0  # PRNG seed for sampling
  cfg.batch_size = 1  # prompts decoded together; each row accepts its own number of tokens
  cfg.dtype = "float32"  # "float32" on CPU; "bfloat16" on GPU/TPU
  cfg.output = ""  # path of a JSON results file; empty = print only
  return cfg
