"""Cache compaction after a tree verify pass: moving each row's accepted path into contiguous slots gives
the cache of feeding the accepted tokens one by one (ragged rows, paths of every depth)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.generation import pad_prompts
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import forward, prefill
from specjax.speculative.trees import tree as tree_lib
from tests.helpers.engine import tiny_model

CONFIG, PARAMS = tiny_model(5, vocab=31, n_layers=2)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7], [2, 7, 1]]
TREE = tree_lib.from_branching((3, 2, 1))
CACHE_LEN = 24


@functools.partial(jax.jit, static_argnames=("tree",))
def _prefilled_forward(prompts_BxP, lengths_B, tokens_BxT, tree=None):
  _, cache = prefill(CONFIG, PARAMS, prompts_BxP, lengths_B, init_cache(CONFIG, len(lengths_B), CACHE_LEN))
  return forward(CONFIG, PARAMS, tokens_BxT, cache, tree)[1]


def test_compacted_tree_cache_equals_feeding_the_path():
  padded, lengths = pad_prompts(PROMPTS)
  rng = np.random.default_rng(0)
  tokens_BxN = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (len(PROMPTS), TREE.nodes_with_root)), jnp.int32)
  nodes = [TREE.nodes_with_root - 1, 0, 5, 2]  # the last leaf, the root alone, depth 2 and depth 1 nodes
  paths_BxDt1 = TREE.path_table()[nodes]
  depths_B = np.asarray(TREE.depth)[nodes]
  tree_cache = _prefilled_forward(padded, lengths, tokens_BxN, tree=TREE)
  compacted = tree_cache.compact(jnp.asarray(paths_BxDt1)).advance(jnp.asarray(depths_B + 1))
  chain_tokens_BxDt1 = jnp.take_along_axis(tokens_BxN, jnp.asarray(paths_BxDt1), axis=1)
  chain_cache = _prefilled_forward(padded, lengths, chain_tokens_BxDt1).advance(jnp.asarray(depths_B + 1))
  np.testing.assert_array_equal(compacted.lengths, chain_cache.lengths)
  for row, length in enumerate(np.asarray(chain_cache.lengths)):
    for got, want in ((compacted.k, chain_cache.k), (compacted.v, chain_cache.v)):
      np.testing.assert_allclose(got[:, row, :length], want[:, row, :length], atol=1e-5, rtol=1e-5)
  # Without compaction the deep rows would hold siblings' keys where the path belongs.
  uncompacted = tree_cache.advance(jnp.asarray(depths_B + 1))
  assert np.abs(
      np.asarray(uncompacted.k[:, 0, :int(chain_cache.lengths[0])] -
                 chain_cache.k[:, 0, :int(chain_cache.lengths[0])])).max() > 1e-3
