"""A drafter whose proposal length peeks at the target: the length choice that the K policy must never
make (it reads the target's distribution of the round being verified), for the exactness test to fail."""

from typing import Any

import flax.struct
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.transformer import forward
from specjax.sampling import probabilities
from specjax.speculative.drafters.model import ModelDrafter


class PeekingDrafter(ModelDrafter):
  """The model drafter, but a row proposes nothing unless the target would surely accept its d_1
  (q(d_1) >= p(d_1), read from the target's distribution after the pending token): biased toward the
  draft's likely tokens."""

  target_config: ModelConfig = flax.struct.field(pytree_node=False, default=None)
  target_params: Any = None

  def propose(self, state, target_cache, pending_B, sampling, key, plan):
    proposal, state, target_cache = super().propose(state, target_cache, pending_B, sampling, key, plan)
    logits_Bx1xV, _ = forward(self.target_config, self.target_params, pending_B[:, None], target_cache)
    target_BxV = probabilities(logits_Bx1xV[:, 0], sampling)
    first_B = proposal.tokens[:, 0]
    sure_B = (jnp.take_along_axis(target_BxV, first_B[:, None], axis=1)[:, 0]
              >= jnp.take_along_axis(proposal.probs[:, 0], first_B[:, None], axis=1)[:, 0])
    return proposal.replace(lengths=jnp.where(sure_B, proposal.lengths, 0)), state, target_cache


class ShallowTreeDrafter(ModelDrafter):
  """The model drafter drafting its tree one level shallower than the policy chose: the deepest level the
  loop verifies holds tokens never drawn (zeros, with probability 0 under the draft), which the tree
  rule then accepts wherever the target gives them mass."""

  def propose(self, state, target_cache, pending_B, sampling, key, plan):
    shallower = plan.replace(wanted_B=jnp.maximum(plan.wanted_B - 1, 0))
    return super().propose(state, target_cache, pending_B, sampling, key, shallower)
