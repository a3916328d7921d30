"""PARD drafts (`student.init = "parallel"`) for `drafters.parallel`: `student.checkpoint` when given, else the
target's first `student.num_layers` blocks, with a mask token appended to the vocabulary, trained to propose
`student.parallel_k` tokens from one pass over PARD's mask blocks (`pard`: COD-dropped by `student.cod_keep` in
training, every anchor in the evaluation). The export adds the mask token beside the HF directory."""

from __future__ import annotations

import functools

from specjax import partitioning
from specjax.distill import pard
from specjax.distill.objectives.draft_model import DraftModel, FromCheckpoint, Truncated
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.load import LoadedModel
from specjax.models.transformer import Params
from specjax.speculative.drafters.parallel import save_mask_token


class Parallel(DraftModel):
  """A draft model with a mask token, trained at every anchor's mask chain."""

  name = "parallel"
  generates = False  # its draft proposes blocks: it continues no rows

  @classmethod
  def check(cls, config) -> None:
    if config.student.parallel_k < 2:
      raise ConfigError(f"student.init 'parallel' needs config.student.parallel_k >= 2 (the tokens one pass "
                        f"proposes), got {config.student.parallel_k}")
    if not 0.0 < config.student.cod_keep <= 1.0:
      raise ConfigError(f"student.init 'parallel' needs config.student.cod_keep in (0, 1] (the anchors whose "
                        f"masks of depth j are kept: keep^j), got {config.student.cod_keep}")

  def init(self, teacher: LoadedModel, part: partitioning.Partitioning | None) -> tuple[ModelConfig, Params]:
    start = FromCheckpoint if self.config.student.checkpoint else Truncated
    student_config, params = pard.with_mask_row(*start(self.config).init(teacher, part))
    return student_config, partitioning.shard_params(student_config, params, part)

  def layouts(self, student_config: ModelConfig) -> tuple[pard.PardLayout, pard.PardLayout]:
    make = functools.partial(pard.pard_layout, self.config.data.seq_len, self.config.student.parallel_k,
                             mask_id=pard.mask_id(student_config), seed=self.config.seed)
    return make(keep=self.config.student.cod_keep), make(keep=1.0)

  def export(self, directory: str, student_config: ModelConfig, params: Params, teacher: LoadedModel) -> None:
    super().export(directory, student_config, params, teacher)
    save_mask_token(directory, pard.mask_id(student_config))
