"""Speculative decoding on the default real pair: Qwen2.5-Coder-1.5B-Instruct (target) drafted by
Qwen2.5-Coder-0.5B-Instruct, both from the registry (`python -m specjax.models fetch NAME`). Every field
is documented in `specjax/decode_config.py`; `--config.drafter=ngram` or `layer_skip` needs no draft."""

from specjax.decode_config import default_config


def get_config():
  cfg = default_config()
  cfg.target = "qwen2.5-coder-1.5b-instruct"
  cfg.draft = "qwen2.5-coder-0.5b-instruct"
  cfg.dtype = "auto"  # bfloat16 (half the bytes) where it runs fast: on a CPU with AVX2+FMA or AVX-512, through
  #                    specjax's matmul kernel; float32 on a CPU without them (the load log says which)
  cfg.prompts = (
      "Write a Python function that checks whether a string is a palindrome.",
      "Write a Python function that returns the n-th Fibonacci number iteratively.",
  )
  cfg.layer_skip.layers = "0-5,7-8,10-11,14,16-17,19-20,22-27"  # --config.drafter=layer_skip: the searched set
  return cfg
