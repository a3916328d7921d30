"""A tiny decode config for tests: the models are tiny HF directories the tests write and pass with
--config.target / --config.draft."""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.target = "tests-will-override"  # HF directory of a tiny target
  cfg.draft = "tests-will-override"  # HF directory of a tiny draft with the same tokenizer
  cfg.mode = "speculative"  # "speculative" or "autoregressive"
  cfg.prompts = ("def add(a, b):", "hello")  # short prompts (a tuple, overridable on the command line)
  cfg.prompts_file = ""  # one prompt per line or .jsonl with "prompt"
  cfg.chat = False  # tiny tokenizers have no chat template
  cfg.max_new_tokens = 12  # small budget
  cfg.k = 3  # draft tokens per round
  cfg.draft_vocab = 0  # > 0: the draft's head scores only this many most frequent tokens (0 = all)
  cfg.draft_vocab_corpus = "stdlib"  # corpus ranking them: "stdlib", a directory, glob, text or JSONL
  cfg.temperature = 0.0  # greedy
  cfg.top_k = 0  # disabled
  cfg.top_p = 1.0  # disabled
  cfg.seed = 0  # sampling seed
  cfg.batch_size = 2  # both prompts in one batch
  cfg.dtype = "float32"  # CPU
  cfg.output = ""  # JSON results path
  return cfg
