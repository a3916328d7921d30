"""TensorBoard event files mirroring metrics.jsonl (`config.tensorboard`), written with tensorboardX.

Two runs under WORKDIR/tensorboard, `train/` and `eval/`, so TensorBoard overlays train and held-out
`loss` under one tag. A resumed run hides what the killed run logged after its checkpoint, with the
same cut as metrics.jsonl (train records after the resume step, evaluations from it): each writer
starts with TensorBoard's purge marker (a SessionLog START at that step). Event file names end in the
writer's start time in nanoseconds: tensorboardX names them by the second, so a run resumed within the
second of its killed predecessor's start would overwrite that file, and TensorBoard reads files in name
order.
"""

from __future__ import annotations

import os
import time

TENSORBOARD_DIR = "tensorboard"


def require():
  """Returns tensorboardX's SummaryWriter, or fails with the install command (checked before a run)."""
  try:
    from tensorboardX import SummaryWriter
  except ImportError as e:
    raise ImportError("config.tensorboard=True needs tensorboardX: pip install 'specjax[tensorboard]'") from e
  return SummaryWriter


class TensorBoard:
  """Numeric fields of each metrics record become scalars `<field>` at the record's step."""
  def __init__(self, workdir: str, resume_step: int):
    SummaryWriter = require()
    root = os.path.join(workdir, TENSORBOARD_DIR)
    resumed = resume_step > 0
    suffix = f".{time.time_ns()}"
    self.writers = {
        "train": SummaryWriter(os.path.join(root, "train"), purge_step=resume_step + 1 if resumed else None,
                               filename_suffix=suffix),
        "eval": SummaryWriter(os.path.join(root, "eval"), purge_step=resume_step if resumed else None,
                              filename_suffix=suffix),
    }

  def write(self, record: dict) -> None:
    """Writes one metrics.jsonl record (its "split" picks the run)."""
    writer = self.writers[record["split"]]
    for name, value in record.items():
      if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
        writer.add_scalar(name, value, record["step"])

  def close(self) -> None:
    for writer in self.writers.values():
      writer.close()
