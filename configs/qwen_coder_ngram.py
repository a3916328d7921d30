"""Prompt lookup (the n-gram drafter) on the Qwen2.5-Coder-1.5B-Instruct target: no draft model. Best on
input-grounded requests (edit, refactor or annotate code given in the prompt); suffixes of 3 to 5 tokens,
K = 8 (experiments/README.md, the drafter benchmark, says why). Fields: specjax/decode_config.py."""

from configs import qwen_coder


def get_config():
  cfg = qwen_coder.get_config()
  cfg.drafter = "ngram"
  cfg.draft = ""  # no draft model
  cfg.k = 8  # tokens copied per round at most
  cfg.ngram.min = 3  # shorter suffixes match often and wrongly in open-ended text
  cfg.ngram.max = 5
  return cfg
