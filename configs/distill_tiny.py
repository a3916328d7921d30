"""Tiny distillation for tests: a 1-layer truncated draft of a tiny target, a few dozen steps.

`target` and `workdir` are given by the caller (the tests build a random tiny checkpoint).
"""

from specjax.distill.config import default_config


def get_config():
  c = default_config()
  c.student.num_layers = 1  # of the tiny target's 2
  c.data.max_train_tokens = 20_000  # a slice of the stdlib sources is plenty
  c.data.max_heldout_tokens = 2_000
  c.data.seq_len = 32
  c.data.prompt_len = 8
  c.data.batch_size = 8
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 4
  c.num_steps = 40
  c.log_every = 10
  c.eval_every = 20
  c.eval_batches = 2
  c.checkpoint_every = 10
  return c
