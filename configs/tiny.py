"""A tiny decode config for tests: the models are tiny HF directories the tests write and pass with
--config.target / --config.draft. Fields: `specjax/decode_config.py`."""

from specjax.decode_config import default_config


def get_config():
  cfg = default_config()
  cfg.target = "tests-will-override"  # HF directory of a tiny target
  cfg.draft = "tests-will-override"  # HF directory of a tiny draft with the same tokenizer
  cfg.prompts = ("def add(a, b):", "hello")
  cfg.chat = False  # tiny tokenizers have no chat template
  cfg.max_new_tokens = 12
  cfg.k = 3
  cfg.k_policy = "fixed"  # K every round; the default ("auto") measures the adaptive policy's costs first
  cfg.batch_size = 2  # both prompts in one batch
  cfg.layer_skip.layers = "0"  # layer_skip: the first layer of the tiny target
  return cfg
