"""bfloat16 done right: a draft identical to the target is accepted every time, greedy and sampled.

In bfloat16 the logits used to be rounded to bfloat16 after the head, and XLA rounded the draft's and
the target's hidden states differently (different programs, fusions and shapes), so an identical draft
was rejected ~2.5% of the time: exact output, silently lower acceptance. The head now accumulates in
float32 and returns float32 logits on every path.
"""

import jax
import jax.numpy as jnp
import pytest

from specjax import metrics, testing
from specjax.sampling import sampling_params
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.loop import SpeculativeLoop
from tests.helpers.engine import tiny_model

PROMPTS = [[5, 17, 3, 44, 9], [1, 2], [60, 1, 2, 3, 4, 5, 6, 7, 8], [7, 7, 7], [33]]


def _bfloat16_model(d_model=64, n_layers=3):
  config, params = tiny_model(0, d_model=d_model, n_layers=n_layers, scale=0.15)
  config = config.replace(dtype="bfloat16")
  return config, jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (0.7, 20, 0.9)])
def test_identical_bfloat16_draft_is_always_accepted(temperature, top_k, top_p):
  config, params = _bfloat16_model()
  drafter = ModelDrafter(config, params)
  batch, k, budget = len(PROMPTS), 4, 40
  request = testing.request(PROMPTS, budget, sampling_params(temperature, top_k, top_p), seed=1)
  out = testing.speculate(SpeculativeLoop(config, k), params, drafter, request, cache_len=64)
  total = metrics.summarize(out.acceptance)["total"]
  assert total["proposed"] >= batch * (budget // (k + 1)) * k  # many rounds, all rows
  assert total["accepted"] == total["proposed"], total
