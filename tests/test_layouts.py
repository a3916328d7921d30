"""The two parameter layouts (`scan_layers`): per-layer subtrees run by a Python loop, or one stacked
subtree run by `lax.scan`. Conversions round-trip exactly, and both give equal logits and the same
greedy tokens: autoregressive, speculative with a draft model, and self-speculation with a subset of
the target's layers (the scan then walks the selected layer indices)."""

import jax
import numpy as np
import pytest

from specjax import autoregressive, testing
from specjax.generation import as_token_lists
from specjax.models.kv_cache import init_cache
from specjax.models.layout import stack_layers, to_layout, unstack_layers
from specjax.models.transformer import forward, init_params
from specjax.sampling import sampling_params
from specjax.speculative.drafters.layer_skip import LayerSkipDrafter
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.loop import SpeculativeLoop
from tests.helpers.engine import tiny_model

PROMPTS = [[5, 17, 3, 44, 9], [1, 2], [60, 1, 2, 3, 4, 5, 6, 7, 8]]
GREEDY = sampling_params(0.0)
TARGET = tiny_model(0, n_layers=4)
DRAFT = tiny_model(5, n_layers=2)


def _stacked(model):
  config, params = model
  config = config.replace(scan_layers=True)
  return config, to_layout(config, params)


def test_layouts_round_trip_exactly():
  config, params = TARGET
  stacked = stack_layers(params, config.n_layers)
  assert "layers_0" not in stacked and jax.tree.leaves(stacked["layers"])[0].shape[0] == config.n_layers
  jax.tree.map(np.testing.assert_array_equal, unstack_layers(stacked), params)
  fresh = init_params(config.replace(scan_layers=True), jax.random.key(0))
  jax.tree.map(np.testing.assert_array_equal, unstack_layers(fresh), init_params(config, jax.random.key(0)))


def test_equal_logits():
  tokens = np.array([[3, 14, 15, 9, 2, 6]])
  logits = [forward(c, p, tokens, init_cache(c, 1, 8))[0] for c, p in (TARGET, _stacked(TARGET))]
  np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def _autoregressive(model):
  config, params = model
  out = autoregressive.generate(config, params, testing.request(PROMPTS, 16, GREEDY), init_cache(config, 3, 40))
  return as_token_lists(out.tokens, out.counts)


def _speculative(target, drafter):
  config, params = target
  out = testing.speculate(SpeculativeLoop(config, 3), params, drafter, testing.request(PROMPTS, 16, GREEDY),
                          cache_len=40)
  return as_token_lists(out.tokens, out.counts)


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["model", "layer_skip"])
def test_same_greedy_tokens(drafter_kind):
  expected = _autoregressive(TARGET)
  assert _autoregressive(_stacked(TARGET)) == expected
  for target, draft in ((TARGET, DRAFT), (_stacked(TARGET), _stacked(DRAFT)), (_stacked(TARGET), DRAFT)):
    drafter = (ModelDrafter(
        *draft) if drafter_kind == "model" else LayerSkipDrafter(target[0], target[1], layers=(0, 2)))
    assert _speculative(target, drafter) == expected
