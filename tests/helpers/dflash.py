"""The DFlash drafter's test kit: random block heads on the tiny targets and its mutant.

Mutant (a subclass of `DFlashDrafter`, a plausible bug the tests must reject):
- `FirstDistributionReported`: every block position reports q_1 (slot 0's distribution) while d_i is
  still drawn from q_i: the rule is handed a distribution the token was not drawn from.
"""

import jax.numpy as jnp

from specjax.speculative.drafters.dflash import DFlashDrafter
from tests.helpers.eagle import eagle_head


class FirstDistributionReported(DFlashDrafter):
  def propose_chain(self, state, pending_B, sampling, key, plan):
    proposal, state = super().propose_chain(state, pending_B, sampling, key, plan)
    probs_BxKxV = None if proposal.probs is None else jnp.broadcast_to(proposal.probs[:, :1], proposal.probs.shape)
    return proposal.replace(probs=probs_BxKxV), state


def dflash_drafter(target, feature_layers=(0, 1, 2), seed=3, final_scale=1.0, cls=DFlashDrafter):
  """A random DFlash head for `target` (config, params) as the drafter `cls`."""
  config, params = eagle_head(target[0], feature_layers, seed, final_scale, mask=True)
  return cls(config, params, target[0], target[1])
