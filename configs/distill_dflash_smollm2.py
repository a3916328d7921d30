"""Train a DFlash block head for SmolLM2-135M-Instruct (`python -m specjax.models fetch smollm2-135m-instruct`
first) on the Python standard library's sources as fixed text (the target's distributions on it are the
labels), sized for a ~20-minute CPU run: rows of 128 tokens, 4 per step, 16 random anchors per row, blocks
of K = 4 ([anchor token, MASK x 3]), slot j's KL weighted exp(-j / 4).

The head is the EAGLE head of configs/distill_eagle_smollm2.py (one block of the target's width reading the
residual streams after target blocks 1, 14 and 26, fused 1728 -> 576; the target's tied embedding and
output head shared and untrained) plus a learned mask embedding, over the full 49,152-token vocabulary.
Same held-out split as the EAGLE and PARD runs. Decode with `python -m specjax.decode --config=...
--config.drafter=dflash --config.draft=<workdir>/export`.
"""

from specjax.distill.config import default_config


def get_config():
  c = default_config()
  c.target = "smollm2-135m-instruct"  # registry name (see `python -m specjax.models list`)
  c.student.init = "dflash_head"
  c.student.feature_layers = "eagle3"  # blocks 1, 14, 26 of 30
  c.student.dflash_block = 4  # K: the block one pass fills (the K the report decodes at)
  c.student.dflash_anchors = 16  # random blocks per row and step
  c.student.dflash_gamma = 4.0  # slot j weighted exp(-j / 4)
  c.data.source = "stdlib"
  c.data.heldout_fraction = 0.05  # ~90 of ~1,800 files, never trained on (the EAGLE run's split)
  c.data.max_heldout_tokens = 65_536
  c.data.seq_len = 128
  c.data.batch_size = 4
  c.data.modes.fixed = 1.0
  c.optim.learning_rate = 1e-3  # a fresh head, as the EAGLE run
  c.optim.warmup_steps = 30
  c.num_steps = 300
  c.log_every = 10
  c.eval_every = 100
  c.eval_batches = 8
  c.checkpoint_every = 20
  c.keep_checkpoints = 2
  return c
