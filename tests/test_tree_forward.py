"""The model API with a tree chunk: each node's logits equal those of a chain forward of the node's
root-to-node path, on ragged rows, with both attention implementations, sliding windows and
`scan_layers` (tiny float32 model, 1e-5)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.generation import pad_prompts
from specjax.models.kv_cache import init_cache
from specjax.models.layout import to_layout
from specjax.models.transformer import forward, prefill
from specjax.speculative.trees import tree as tree_lib
from tests.helpers.engine import tiny_model

BASE = tiny_model(5, vocab=31, n_layers=2)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7]]
CACHE_LEN = 24
TREES = {
    "branching": tree_lib.from_branching((3, 2, 1)), "paths": tree_lib.from_paths([[0], [1], [2], [0, 0], [0, 1],
                                                                                   [1, 0], [0, 0, 0], [0, 1, 0]]),
    "chain": tree_lib.chain(3)
}
VARIANTS = {
    "dense": dict(attention_block=0), "blockwise": dict(attention_block=4),
    "scan": dict(attention_block=4,
                 scan_layers=True), "windows_dense": dict(attention_block=0, sliding_window=3,
                                                          layer_types=("sliding_attention", "full_attention")),
    "windows_blockwise": dict(attention_block=4, sliding_window=3, layer_types=("sliding_attention", "full_attention"))
}


def _variant(name):
  config, params = BASE
  config = dataclasses.replace(config, **VARIANTS[name])
  return config, to_layout(config, params)


@functools.partial(jax.jit, static_argnames=("config", "tree"))
def _prefilled_forward(config, params, prompts_BxP, lengths_B, tokens_BxT, tree=None):
  cache = init_cache(config, len(lengths_B), CACHE_LEN)
  _, cache = prefill(config, params, prompts_BxP, lengths_B, cache)
  return forward(config, params, tokens_BxT, cache, tree)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tree_name", sorted(TREES))
def test_tree_logits_equal_chain_logits_of_each_path(tree_name, variant):
  config, params = _variant(variant)
  tree = TREES[tree_name]
  padded, lengths = pad_prompts(PROMPTS)
  rng = np.random.default_rng(0)
  tokens_BxN = jnp.asarray(rng.integers(0, config.vocab_size, (len(PROMPTS), tree.nodes_with_root)), jnp.int32)
  tree_logits_BxNxV, _ = _prefilled_forward(config, params, padded, lengths, tokens_BxN, tree=tree)
  paths = tree.path_table()
  for node in range(tree.nodes_with_root):
    path = paths[node, :tree.depth[node] + 1]
    chain_logits_BxTxV, _ = _prefilled_forward(config, params, padded, lengths, tokens_BxN[:, path])
    np.testing.assert_allclose(tree_logits_BxNxV[:, node], chain_logits_BxTxV[:, -1], atol=1e-5, rtol=1e-5)


@dataclasses.dataclass(frozen=True)
class _CausalTree:
  """A broken tree mask: a tree's depths, but every node sees every chunk slot before it."""

  depth: tuple[int, ...]
  first = 0

  @property
  def key_depth(self):
    return self.depth

  def ancestor_mask(self):
    return np.tril(np.ones((len(self.depth),) * 2, bool))


def test_a_sibling_changes_nothing_but_a_missing_mask_would():
  """The test above can fail: attending to every chunk slot (a causal chain mask over a tree) changes
  the logits of nodes that have a non-ancestor before them."""
  config, params = _variant("dense")
  tree = TREES["branching"]
  padded, lengths = pad_prompts(PROMPTS)
  tokens_BxN = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (3, tree.nodes_with_root)))
  as_tree, _ = _prefilled_forward(config, params, padded, lengths, tokens_BxN, tree=tree)
  as_broken, _ = _prefilled_forward(config, params, padded, lengths, tokens_BxN, tree=_CausalTree(tree.depth))
  np.testing.assert_allclose(as_tree[:, :2], as_broken[:, :2], atol=1e-6)  # root, first child: same
  assert np.abs(np.asarray(as_tree[:, 2:] - as_broken[:, 2:])).max() > 1e-3


@functools.partial(jax.jit, static_argnames=("config", "tree"))
def _levels_forward(config, params, prompts_BxP, lengths_B, tokens_BxN, tree):
  """The tree fed one depth level per pass (`Tree.level`), as the draft model feeds it."""
  cache = init_cache(config, len(lengths_B), CACHE_LEN)
  _, cache = prefill(config, params, prompts_BxP, lengths_B, cache)
  logits = []
  for depth in range(tree.max_depth + 1):
    level = tree.level(depth)
    level_logits, cache = forward(config, params, tokens_BxN[:, level.first:level.first + level.count], cache, level)
    logits.append(level_logits)
  return jnp.concatenate(logits, axis=1), cache


@pytest.mark.parametrize("variant", ["dense", "windows_blockwise", "scan"])
def test_level_by_level_passes_equal_one_tree_pass(variant):
  config, params = _variant(variant)
  tree = TREES["paths"]
  padded, lengths = pad_prompts(PROMPTS)
  tokens_BxN = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (3, tree.nodes_with_root)))
  whole_logits, whole_cache = _prefilled_forward(config, params, padded, lengths, tokens_BxN, tree=tree)
  level_logits, level_cache = _levels_forward(config, params, padded, lengths, tokens_BxN, tree)
  np.testing.assert_allclose(level_logits, whole_logits, atol=1e-5, rtol=1e-5)
  for row, length in enumerate(lengths):
    end = length + tree.nodes_with_root
    np.testing.assert_allclose(level_cache.k[:, row, :end], whole_cache.k[:, row, :end], atol=1e-5, rtol=1e-5)
