"""Tiny PARD distillation for tests: the tiny config (`distill_tiny`) training a parallel draft (K = 3,
conditional drop 0.7); its summary reports the held-out acceptance per draft position before and after.

`target` and `workdir` are given by the caller (the tests build a random tiny checkpoint).
"""

from configs import distill_tiny


def get_config():
  c = distill_tiny.get_config()
  c.student.init = "parallel"
  c.student.parallel_k = 3
  c.student.cod_keep = 0.7
  return c
