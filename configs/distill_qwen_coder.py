"""Distil Qwen2.5-Coder-0.5B-Instruct toward Qwen2.5-Coder-1.5B-Instruct (the default decode pair) on
the Python standard library's sources. Same recipe as configs/distill_smollm2.py, on a machine that
holds it (`python -m specjax.models fetch qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct`).

Memory: teacher 1.78B + draft 0.63B parameters, the draft's gradients and two Adam moments, and
~6 float32 logit tensors of batch x seq_len x 151,936: about 23 GB in float32 at 4 x 256 tokens (use a
32 GB+ machine), about half with `--config.dtype=bfloat16` on a GPU. Compute: ~7.5 TFLOP per step
(teacher forward + draft forward and backward of 1,024 tokens), i.e. minutes per step on 2 CPU cores:
run it on an accelerator.
"""

from configs import distill_smollm2


def get_config():
  c = distill_smollm2.get_config()
  c.target = "qwen2.5-coder-1.5b-instruct"
  c.student.init = "checkpoint"  # the released 0.5B draft; same 151,936-id vocabulary and tokenizer
  c.student.checkpoint = "qwen2.5-coder-0.5b-instruct"
  c.optim.learning_rate = 5e-5  # a trained model: gentler than the truncated SmolLM2 draft
  return c
