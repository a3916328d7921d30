"""Tiny DFlash distillation for tests: the tiny config (`distill_tiny`) training a DFlash block head (K = 3,
8 random anchors per row) on both of the tiny target's layers; its summary reports the held-out expected
acceptance per block slot before and after.

`target` and `workdir` are given by the caller (the tests build a random tiny checkpoint).
"""

from configs import distill_tiny


def get_config():
  c = distill_tiny.get_config()
  c.student.init = "dflash_head"
  c.student.feature_layers = "0,1"  # the tiny target has 2 layers (EAGLE-3's choice needs 4)
  c.student.dflash_block = 3
  c.student.dflash_anchors = 8
  return c
