"""Train an EAGLE-3-style head for SmolLM2-135M-Instruct (`python -m specjax.models fetch
smollm2-135m-instruct` first) on the Python standard library's sources, as fixed text: the target's
distributions on that text are the labels. Target-regenerated continuations (`data.modes.target`) cost
12.1 s per 4 x 192-token batch on 2 CPU cores, about 4x a training step, so this CPU run leaves them
out (EAGLE-1 trained on a fixed dataset and reports a small effect of regenerating it); set
`--config.data.modes.target=0.5` to regenerate a third of the batches.

The head is one block of the target's width (576, 9 heads / 3 KV heads, MLP 1536) reading the residual
streams after target blocks 1, 14 and 26 (EAGLE-3's low / middle / high of 30), fused 1728 -> 576, with
the target's tied embedding shared and untrained: ~5M trained parameters against the 4-block distilled
draft's 42M. It trains and drafts over the 8,192 tokens most frequent in the training rows (98.7% of
them; `student.draft_vocab`, exported with the head), which halves a step's cost on a CPU: the output
projection onto all 49,152 tokens was half of it. Loss: EAGLE-3's training-time test over 4 drafting
steps (weights 0.8^j; EAGLE-3 unrolls 7, 4 is the K the run is judged at). Held-out `acceptance`
(first-step expected acceptance at T = 1, against the target's full distribution) and
`acceptance_length` (simulated accepted draft tokens per round at K = 4) go to metrics.jsonl. Measured
on a 2-core host without AVX-512: ~5.8 s per step (~10-12 s over the full vocabulary). Decode with
`python -m specjax.decode --config=... --config.drafter=eagle --config.draft=<workdir>/export`.
"""

from specjax.distill.config import default_config


def get_config():
  c = default_config()
  c.target = "smollm2-135m-instruct"  # registry name (see `python -m specjax.models list`)
  c.student.init = "eagle_head"
  c.student.feature_layers = "eagle3"  # blocks 1, 14, 26 of 30
  c.student.ttt_steps = 4  # drafting steps unrolled (EAGLE-3 uses 7; 4 = the K the run is judged at)
  c.student.draft_vocab = 8192  # the head trains and drafts over the 8,192 most frequent training tokens
  c.data.source = "stdlib"
  c.data.heldout_fraction = 0.05  # ~90 of ~1,800 files, never trained on
  c.data.max_heldout_tokens = 65_536
  c.data.seq_len = 256
  c.data.batch_size = 4
  c.data.modes.fixed = 1.0
  c.data.modes.target = 0.0  # > 0: that share of batches continued by the target from a 64-token prompt (T = 1)
  c.data.modes.student = 0.0  # a head generates nothing alone
  c.data.prompt_len = 64
  c.data.temperature = 1.0
  c.optim.learning_rate = 1e-3  # a fresh head (EAGLE-3 trains at 5e-5 on 8B targets with far larger batches)
  c.optim.warmup_steps = 100
  c.num_steps = 1000
  c.log_every = 10
  c.eval_every = 100
  c.eval_batches = 8
  c.checkpoint_every = 20
  c.keep_checkpoints = 2
  c.keep_every = 250
  return c
