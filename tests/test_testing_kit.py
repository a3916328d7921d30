"""`specjax.testing` catches what it exists to catch: a drafter that reports a distribution other than
the one it drew from fails `check_sampled` (the same drafter reporting truthfully passes it), and its
one call of the loop is the loop the engine tests run."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.speculative.drafters.model import ModelDrafter

TARGET = testing.tiny_model(10, vocab=8, n_layers=2, scale=0.5)
DRAFT = testing.perturbed(TARGET, 0.05, seed=11)


class Misreporting(ModelDrafter):
  """Draws its tokens from the draft model but reports uniform distributions to the rule: the ratio
  test then accepts by the wrong odds (the output is no longer the target's law)."""
  def propose(self, state, target_cache, pending_B, sampling, key, plan):
    proposal, state, target_cache = super().propose(state, target_cache, pending_B, sampling, key, plan)
    return proposal.replace(probs=jnp.full_like(proposal.probs, 1.0 / proposal.probs.shape[-1])), state, target_cache


def test_a_drafter_reporting_the_wrong_distribution_fails_the_sampled_check():
  """5,000 rows, first 3 tokens at T = 1, level 0.001: the truthful drafter passes, the misreporting one
  is rejected (its first position alone follows min(1, q/u) instead of min(1, q/p))."""
  assert testing.check_sampled(ModelDrafter(*DRAFT), TARGET) > 1e-3
  with pytest.raises(AssertionError, match=r"do not follow the target \(p = "):
    testing.check_sampled(Misreporting(*DRAFT), TARGET)


def test_the_greedy_check_compares_every_row_with_the_targets_own_decoding():
  out = testing.check_greedy(ModelDrafter(*DRAFT), TARGET)
  assert np.asarray(out.acceptance.accepted).sum() > 0  # the draft agrees often: rounds accepted tokens
  assert [len(row) for row in testing.target_greedy(TARGET)] == [12] * len(testing.PROMPTS)
  with pytest.raises(ValueError, match="enumerates V\\^steps = 61\\^4"):
    testing.check_sampled(ModelDrafter(*testing.tiny_model(1)), testing.tiny_model(0), steps=4)
