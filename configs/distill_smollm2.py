"""The real experiment: distil SmolLM2-135M-Instruct's first layers into a draft for itself, on the
Python standard library's sources (`python -m specjax.models fetch smollm2-135m-instruct` first).

The draft keeps the target's embeddings, final norm and tied head plus its first `student.num_layers`
of 30 blocks (4 blocks: 42M of 135M parameters, the 28M-parameter tied head included). Mostly the
stdlib text itself, one batch in three continued by the draft itself (on-policy, DistillSpec), forward
KL at temperature 1. Cost: a step of 4 x 256 tokens is ~0.5 TFLOP (teacher forward + draft forward and
backward); it took ~19 s on the 2 shared CPU cores here (nice 10), so 1000 steps (1M tokens) take about
6 hours; a GPU does it in minutes. fp32 memory: ~5 GB.
"""

from specjax.distill.config import default_config


def get_config():
  c = default_config()
  c.target = "smollm2-135m-instruct"  # registry name (see `python -m specjax.models list`)
  c.student.init = "truncate"
  c.student.num_layers = 4  # of the target's 30
  c.data.source = "stdlib"
  c.data.heldout_fraction = 0.05  # ~90 of ~1,800 files, never trained on
  c.data.max_heldout_tokens = 65_536  # the first ~64k held-out tokens are plenty for the eval batches
  c.data.seq_len = 256
  c.data.batch_size = 4
  c.data.modes.fixed = 2.0
  c.data.modes.student = 1.0  # on-policy: the draft continues a 64-token prompt with 192 sampled tokens
  c.data.prompt_len = 64
  c.data.temperature = 1.0
  c.loss.divergence = "forward_kl"
  c.optim.learning_rate = 2e-4
  c.optim.warmup_steps = 100
  c.num_steps = 1000
  c.log_every = 10
  c.eval_every = 100
  c.eval_batches = 8  # 8 x 4 x 256 = 8k held-out tokens (~2 min per evaluation on the CPU)
  c.checkpoint_every = 20  # ~7 minutes of work at most is lost to a kill
  c.keep_checkpoints = 2
  c.keep_every = 250
  return c
