"""Draft models (`student.init` "truncate", "fresh", "checkpoint"): a model of the target's vocabulary
trained toward the target's distribution at every position by the configured divergence (`steps`),
with frozen parts (`student.frozen_labels`), on a mesh too; it generates the on-policy rows and exports
as a Hugging Face directory. The three differ only in how the draft starts (`student`)."""

from __future__ import annotations

import jax

from specjax import partitioning
from specjax.distill import steps, student
from specjax.distill.export import export_hf
from specjax.distill.objective import Objective, StepContext, Steps
from specjax.distill.pard import PlainLayout
from specjax.models.config import ModelConfig
from specjax.models.load import LoadedModel, load_model
from specjax.models.transformer import Params


class DraftModel(Objective):
  """A draft model; a subclass says how it starts (`init`, per-layer layout)."""

  generates = True

  def labels(self, student_config: ModelConfig, params: Params):
    spec = self.config.student
    return student.frozen_labels(student_config, params, spec.freeze_embeddings, spec.freeze_head,
                                 tuple(spec.freeze_layers))

  def layouts(self, student_config: ModelConfig) -> tuple[PlainLayout, PlainLayout]:
    """The nodes the draft trains at and is evaluated at (`pard`): here the rows themselves."""
    return PlainLayout(), PlainLayout()

  def steps(self, context: StepContext) -> Steps:
    config = self.config
    train_layout, eval_layout = self.layouts(context.student)
    return Steps(
        steps.make_train_step(context.teacher, context.student.replace(remat=config.remat), context.optimizer,
                              context.labels, config.loss, config.accum_steps, context.placement, train_layout),
        steps.make_eval_step(context.teacher, context.student, config.loss, config.eval_temperature, context.placement,
                             eval_layout))

  def run_params(self, student_config: ModelConfig, master: Params) -> Params:
    return steps.model_params(student_config, master)

  def export(self, directory: str, student_config: ModelConfig, params: Params, teacher: LoadedModel) -> None:
    export_hf(directory, student_config, params, teacher.tokenizer)

  def latest(self, teacher: LoadedModel, student_config: ModelConfig, master: Params, step: int,
             part: partitioning.Partitioning | None) -> tuple[LoadedModel, LoadedModel, int]:
    """(teacher, the draft as a model, step)."""
    draft = LoadedModel(f"{teacher.name}-draft-step{step}", student_config, self.run_params(student_config, master),
                        teacher.tokenizer, part)
    return teacher, draft, step


class Truncated(DraftModel):
  """The target's first `student.num_layers` blocks with its embeddings, final norm and head."""

  name = "truncate"

  def init(self, teacher: LoadedModel, part: partitioning.Partitioning | None) -> tuple[ModelConfig, Params]:
    student_config, params = student.truncate(teacher.config, teacher.params, self.config.student.num_layers)
    return student_config, partitioning.shard_params(student_config, params, part)


class FromCheckpoint(DraftModel):
  """`student.checkpoint`: any model `load_model` loads, of the target's vocabulary and tokenizer."""

  name = "checkpoint"

  def init(self, teacher: LoadedModel, part: partitioning.Partitioning | None) -> tuple[ModelConfig, Params]:
    path = self.config.student.checkpoint
    draft = load_model(path, self.config.dtype, part)
    student.check_vocab(draft.config, teacher.config, f"student {path}")
    if draft.tokenizer.fingerprint() != teacher.tokenizer.fingerprint():
      raise ValueError(f"student {path} has a different tokenizer than the target {teacher.name}")
    return draft.config, student.per_layer(draft.params)


class Fresh(DraftModel):
  """A random model of the target's architecture and vocabulary, sized by the `student` fields."""

  name = "fresh"

  def init(self, teacher: LoadedModel, part: partitioning.Partitioning | None) -> tuple[ModelConfig, Params]:
    student_config, params = student.fresh(teacher.config, self.config.student, jax.random.key(self.config.seed + 1))
    return student_config, partitioning.shard_params(student_config, params, part)
