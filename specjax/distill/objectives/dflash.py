"""DFlash block heads (`student.init = "dflash_head"`) for `drafters.dflash`: the EAGLE head (`eagle`: same
features, on one device, same export) with a learned mask embedding, trained whole on blocks of
`student.dflash_block` slots below `student.dflash_anchors` random anchors per row, slot j's KL weighted
exp(-j / `student.dflash_gamma`) (`dflash_steps`)."""

from __future__ import annotations

from specjax.distill import dflash_steps, eagle_steps
from specjax.distill.objective import StepContext, Steps
from specjax.distill.objectives.eagle import EagleHead
from specjax.errors import ConfigError


class DFlashHead(EagleHead):
  """An EAGLE head with a mask embedding, trained by the block loss at anchors drawn from the step's key."""

  name = "dflash_head"
  owns = ()  # the EAGLE head's restricted vocabulary and feature regression are not the block head's
  mask_embedding = True

  @classmethod
  def check(cls, config) -> None:
    super().check(config)
    spec = config.student
    for field in ("dflash_block", "dflash_anchors"):
      if spec[field] < 1:
        raise ConfigError(f"student.init 'dflash_head' needs config.student.{field} >= 1, got {spec[field]}")
    if not spec.dflash_gamma > 0:
      raise ConfigError(f"student.init 'dflash_head' needs config.student.dflash_gamma > 0, got {spec.dflash_gamma}")

  def steps(self, context: StepContext) -> Steps:
    spec = self.config.student
    objective = dflash_steps.BlockObjective(spec.dflash_block, spec.dflash_anchors, spec.dflash_gamma)
    head, target = context.student, context.teacher

    def loss(params, target_params, tokens_BxT, mask_BxT, vocab, key):
      return dflash_steps.block_loss(head, params, target, target_params, tokens_BxT, mask_BxT, objective, key)[0]

    def sums(params, target_params, tokens_BxT, mask_BxT, vocab):
      return dflash_steps.eval_sums(head, params, target, target_params, tokens_BxT, mask_BxT, objective)

    return Steps(eagle_steps.make_head_train_step(head, *context.optimizer, loss),
                 eagle_steps.make_head_eval_step(head, sums))
