"""EAGLE heads (`student.init = "eagle_head"`) for `drafters.eagle`: one block reading the target's features
(`student.feature_layers`) that shares the target's embedding and output head (the target's, untrained) and
trains whole by the training-time test (`eagle_steps`: `student.ttt_steps`, `student.feature_loss_weight`),
on one device. `student.draft_vocab` > 0 trains and exports it over the Vd tokens most frequent in the training
rows, ranked once and kept in WORKDIR/head_vocab.npy ([Vd] int32). The export is specjax's head layout
(`eagle_io`)."""

from __future__ import annotations

import functools
import os
from typing import ClassVar

import jax
import numpy as np

from specjax import draft_vocab, mesh as meshes
from specjax.distill import eagle_steps, student
from specjax.distill.data import Packed
from specjax.distill.objective import Objective, StepContext, Steps
from specjax.errors import ConfigError
from specjax.models import vocab_map
from specjax.models.load import LoadedModel
from specjax.models.transformer import Params
from specjax.speculative.drafters.draft_head import DraftHead, restrict_head
from specjax.speculative.drafters.eagle_head import EagleConfig, check_head, head_config, init_head_params
from specjax.speculative.drafters.eagle_io import save_head

HEAD_VOCAB_FILE = "head_vocab.npy"  # in the work directory: the restricted vocabulary's token ids [Vd]


class EagleHead(Objective):
  """An EAGLE head on the target's features; `vocab` its restricted vocabulary (None: all V tokens)."""

  name = "eagle_head"
  owns = ("draft_vocab", "feature_loss_weight")
  mask_embedding: ClassVar[bool] = False  # a DFlash head adds one

  def __init__(self, config):
    super().__init__(config)
    self.vocab: DraftHead | None = None

  @classmethod
  def check(cls, config) -> None:
    """A head trains on one device, whole (no accumulation or remat), and here its own fields."""
    one_device = {
        "mesh": (config.mesh.strip(), ""), "accum_steps": (config.accum_steps, 1), "remat": (config.remat, False)
    }
    for field, (value, alone) in one_device.items():
      if value != alone:
        raise ConfigError(f"config.{field} = {value!r}: student.init {cls.name!r} trains on one device, without "
                          f"accum_steps or remat: set {field}={alone!r}")
    if config.student.draft_vocab < 0:
      raise ConfigError(f"config.student.draft_vocab must be a count Vd > 0 of tokens (0 = the full vocabulary), "
                        f"got {config.student.draft_vocab}")
    if config.student.feature_loss_weight and config.student.feature_layers != "last":
      raise ConfigError("config.student.feature_loss_weight (EAGLE-1's feature regression) needs "
                        "student.feature_layers 'last'")

  def init(self, teacher: LoadedModel, part=None) -> tuple[EagleConfig, Params]:
    """A random head (one block of the target's width), every leaf trained."""
    config = head_config(teacher.config,
                         student.feature_layers(self.config.student.feature_layers, teacher.config.n_layers))
    params = init_head_params(config, jax.random.key(self.config.seed + 1), mask=self.mask_embedding)
    check_head(config, params, teacher.config)
    return config, params

  def prepare(self, workdir: str, teacher: LoadedModel, train_rows: Packed) -> None:
    """Ranks the restricted vocabulary (the `student.draft_vocab` tokens most frequent in the training rows,
    stop tokens included) and keeps it in `workdir`; a resumed run must rank the same one."""
    size = self.config.student.draft_vocab
    if not size:
      return
    counts_V = np.bincount(train_rows.tokens[train_rows.mask], minlength=teacher.config.vocab_size)
    try:
      tokens_Vd = np.asarray(draft_vocab.most_frequent(counts_V, size, always=teacher.tokenizer.eos_ids), np.int32)
    except ValueError as e:
      raise ConfigError(f"config.student.draft_vocab: {e}") from None
    print(
        f"the head trains over {len(tokens_Vd)} of {teacher.config.vocab_size} tokens, "
        f"{vocab_map.coverage(counts_V, tokens_Vd):.2%} of the training tokens", flush=True)
    path = os.path.join(workdir, HEAD_VOCAB_FILE)
    if os.path.exists(path) and not np.array_equal(np.load(path), tokens_Vd):
      raise ConfigError(f"{path} holds another restricted vocabulary than config.student.draft_vocab "
                        f"{len(tokens_Vd)} ranks from these training rows: use a new work directory")
    if meshes.is_main_process():
      np.save(path + ".tmp.npy", tokens_Vd)
      os.replace(path + ".tmp.npy", path)
    self.vocab = restrict_head(teacher.config, teacher.params, tokens_Vd)

  def steps(self, context: StepContext) -> Steps:
    spec = self.config.student
    train = eagle_steps.make_train_step(context.student, context.teacher, *context.optimizer, spec.ttt_steps,
                                        spec.feature_loss_weight)
    evaluate = eagle_steps.make_eval_step(context.student, context.teacher, spec.ttt_steps, spec.feature_loss_weight)
    return Steps(functools.partial(train, vocab=self.vocab), functools.partial(evaluate, vocab=self.vocab))

  def run_params(self, head_config: EagleConfig, master: Params) -> Params:
    return eagle_steps.run_params(head_config, master)

  def export(self, directory: str, head_config: EagleConfig, params: Params, teacher: LoadedModel) -> None:
    save_head(directory, head_config, params, self.vocab)

  def latest(self, teacher: LoadedModel, head_config: EagleConfig, master: Params, step: int,
             part=None) -> tuple[LoadedModel, EagleConfig, Params, DraftHead | None, int]:
    """(teacher, head config, its params in the head's dtype, its restricted vocabulary or None, step): what
    `save_head` exports."""
    if self.config.student.draft_vocab:
      tokens_Vd = np.load(os.path.join(self.config.workdir, HEAD_VOCAB_FILE))
      self.vocab = restrict_head(teacher.config, teacher.params, tokens_Vd)
    return teacher, head_config, self.run_params(head_config, master), self.vocab, step
