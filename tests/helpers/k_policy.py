"""The adaptive policy the tests run (`POLICY`, its costs at K = 3: `COSTS_K3`, `tree_costs`); a drafter
whose proposal length peeks at the target: the length choice that the K policy must never make (it reads
the target's distribution of the round being verified), for the exactness test to fail; and the check
every adaptive test makes that its rounds drafted (`assert_rounds_draft`)."""

from typing import Any

import flax.struct
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.transformer import forward
from specjax.sampling import probabilities
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.k_policy import Adaptive

# Adaptive with fast-moving estimates, so that a short decode visits several lengths; the costs make
# long proposals pay only while acceptance stays high (at the prior 0.8: L = 3 is best).
POLICY = Adaptive(prior=0.8, decay=0.5, recovery=0.3)
COSTS_K3 = np.array([1.0, 1.5, 1.9, 2.2], np.float32)  # lengths (0, 1, 2, 3)


def tree_costs(tree):
  """A cost table for `tree`'s candidates at K = 3: COSTS_K3 by depth, the whole cut 5% more per node
  beyond the spine's (so both widths get chosen as the estimates move)."""
  return np.array([
      COSTS_K3[c.length] * (1 + 0.05 * (c.nodes(tree) - c.length - 1)) for c in POLICY.candidates(3, tree)
  ], np.float32)


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


def assert_rounds_draft(out, candidates, accepting: bool = True) -> None:
  """The adaptive policy's rounds did what it chose, read from the loop's stats: some round chose to draft
  (a candidate of length L > 0, `rounds_per_length`); every round that chose the plain step (L = 0)
  reached no draft position in any row (so each adds at least one row-round that did not reach position
  1: `acceptance.reached_at`); and, for a draft that agrees with the target at all (`accepting`), some
  draft token was accepted, so some drafting round was verified as drafted. A loop that verified other
  than it chose (adaptive lengths left unclipped: every static-tree round verified as a plain step,
  still exact) fails here, not in the exactness tests."""
  rounds_C = np.asarray(out.rounds_per_length)
  lengths_C = np.array([c.length for c in candidates])
  drafting, plain = int(rounds_C[lengths_C > 0].sum()), int(rounds_C[lengths_C == 0].sum())
  row_rounds = int(np.asarray(out.acceptance.rounds).sum())
  reached_first = int(np.asarray(out.acceptance.reached_at)[:, 0].sum())
  accepted = int(np.asarray(out.acceptance.accepted).sum())
  assert drafting > 0, f"no round chose to draft: rounds per candidate {rounds_C.tolist()}"
  assert row_rounds - reached_first >= plain, (
      f"{plain} rounds chose the plain step, but only {row_rounds - reached_first} of {row_rounds} row-rounds "
      "reached no draft position: the rounds verified other than the policy chose")
  assert not accepting or accepted > 0, f"{drafting} drafting rounds accepted nothing: were they verified as drafted?"
