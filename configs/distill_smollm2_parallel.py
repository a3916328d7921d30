"""PARD against autoregressive distillation on SmolLM2-135M-Instruct (`python -m specjax.models fetch
smollm2-135m-instruct` first): its first 4 of 30 blocks (configs/distill_smollm2.py's draft) trained as a
parallel draft for K = 4 (`:parallel`, student.init "parallel", conditional drop 0.7) or as the usual
autoregressive draft (`:autoregressive`, student.init "truncate"), with the same data, batches, optimiser
and steps: fixed stdlib text only (no on-policy rows: a parallel draft generates none), 4 x 128 tokens
per step, a short run (this is a 2-core CPU; see experiments/README.md, "Parallel drafting").

  python -m specjax.distill --config=configs/distill_smollm2_parallel.py:parallel --config.workdir=WORKDIR
  python -m specjax.distill --config=configs/distill_smollm2_parallel.py:autoregressive --config.workdir=WORKDIR
"""

from configs import distill_smollm2

VARIANTS = ("parallel", "autoregressive")


def get_config(variant: str = "parallel"):
  if variant not in VARIANTS:
    raise ValueError(f"configs/distill_smollm2_parallel.py:<variant> must be one of {VARIANTS}, got {variant!r}")
  c = distill_smollm2.get_config()
  c.student.init = "parallel" if variant == "parallel" else "truncate"
  c.student.parallel_k = 4
  c.student.cod_keep = 0.7
  c.data.seq_len = 128
  c.data.batch_size = 4
  c.data.modes.fixed, c.data.modes.student = 1.0, 0.0
  c.optim.learning_rate = 5e-4  # a short run: a higher peak than the 1000-step run's 2e-4
  c.optim.warmup_steps = 5
  c.num_steps = 40
  c.log_every = 5
  c.eval_every = 40
  c.eval_batches = 4  # 4 x 4 x 128 = 2k held-out tokens
  c.checkpoint_every = 10
  return c
