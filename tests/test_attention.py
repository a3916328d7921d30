"""Live-length attention and chunked prefill against their dense, one-shot references.

`blockwise` must equal `dense` for ragged lengths, sliding windows, one query or a K + 1 block, caches
whose size is not a multiple of the block (the overhanging last block) and blocks larger than the
cache; and it must not read past the live blocks (NaNs there would poison a dense pass). Per query, a
chain of T queries must compute each query bit for bit as one query does. Chunked prefill must give the
one-shot prefill's logits and cache, whatever the chunk size.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.generation import pad_prompts
from specjax.models import attention
from specjax.models.attention_mask import Mask
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import prefill
from tests.helpers.engine import tiny_model

B, H_KV, GROUPS, D = 3, 2, 2, 8


def _inputs(seed, T, S, lengths):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  # A 3-layer cache; the tests attend to layer 1.
  return (normal(B, T, H_KV, GROUPS, D), normal(3, B, S, H_KV, D), normal(3, B, S, H_KV,
                                                                          D), jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("T, S, block, window", [(1, 37, 8, 0), (6, 37, 8, 0), (6, 64, 16, 5), (1, 64, 16, 5),
                                                 (6, 37, 64, 0), (4, 40, 8, 3)])
def test_blockwise_equals_dense(T, S, block, window):
  for seed in range(4):
    lengths = np.random.default_rng(100 + seed).integers(0, S - T + 1, size=B)
    q, k, v, lengths_B = _inputs(seed, T, S, lengths)
    expected = attention.dense(q, k, v, 1, Mask(lengths_B, window))
    got, _, _ = jax.jit(lambda q, k, v, lengths_B: attention.blockwise(q, k, v, 1, Mask(lengths_B, window), block))(
        q, k, v, lengths_B)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"lengths {lengths}")


@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_blockwise_equals_dense_with_softcap_and_traced_windows(softcap):
  """Per-layer windows picked by a traced layer index (as under `scan_layers`), a non-default scale and
  Gemma 2's score soft-capping: blockwise still equals dense, for a windowed and a global layer, and
  the cap and the window change the result (so a dropped one would show)."""
  T, S, block, scale = 4, 40, 8, 0.3
  windows = jnp.asarray([5, 0, 5], jnp.int32)
  lengths = np.array([3, 30, 17])
  q, k, v, lengths_B = _inputs(7, T, S, lengths)
  q = q * 4  # scores of a few units, where a cap of 1.5 bites

  @jax.jit
  def both(layer):
    window = windows[layer]
    return (attention.dense(q, k, v, layer, Mask(lengths_B, window), scale, softcap),
            attention.blockwise(q, k, v, layer, Mask(lengths_B, window), block, (scale, softcap))[0])

  for layer in (0, 1):
    expected, got = both(jnp.int32(layer))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    static = attention.dense(q, k, v, layer, Mask(lengths_B, int(windows[layer])), scale, softcap)
    np.testing.assert_allclose(expected, static, rtol=1e-6, atol=1e-6)
  uncapped = attention.dense(q, k, v, 0, Mask(lengths_B, 5), scale)
  global_layer = attention.dense(q, k, v, 0, Mask(lengths_B, 0), scale, softcap)
  assert not np.allclose(both(jnp.int32(0))[0], global_layer, atol=1e-3)
  assert softcap == 0 or not np.allclose(both(jnp.int32(0))[0], uncapped, atol=1e-3)


@pytest.mark.parametrize("window", [0, 6])
def test_blockwise_reads_only_the_live_blocks(window):
  """NaN keys and values outside the blocks the batch's queries can see change nothing."""
  T, S, block = 3, 96, 8
  lengths = np.array([30, 41, 35])
  q, k, v, lengths_B = _inputs(0, T, S, lengths)
  expected = attention.dense(q, k, v, 1, Mask(lengths_B, window))
  first = (lengths.min() - window + 1) // block * block if window else 0
  last = -(-(lengths.max() + T) // block) * block
  outside_S = (np.arange(S) < first) | (np.arange(S) >= last)
  poison = lambda x: jnp.where(outside_S[None, None, :, None, None], jnp.nan, x)
  got, _, _ = attention.blockwise(q, poison(k), poison(v), 1, Mask(lengths_B, window), block)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  # The same poison reaches a dense pass: the test would see a blockwise pass that reads everything.
  assert np.isnan(attention.dense(q, poison(k), poison(v), 1, Mask(lengths_B, window))).any()


# (B, G, Hg, Dh, S, block): a block that overhangs S, and a block larger than S.
@pytest.mark.parametrize("shape, Ts, dtype, softcap", [((2, 4, 1, 8, 60, 16), (2, 6), jnp.float32, 0.0),
                                                       ((3, 2, 3, 16, 50, 64), (6,), jnp.float32, 1.5),
                                                       ((2, 4, 1, 8, 60, 16), (5,), jnp.bfloat16, 0.0)])
def test_per_query_equals_one_query_bitwise(shape, Ts, dtype, softcap):
  """`per_query` (the batch-invariant mode's chains, `attend`): query t of a T-query pass is bit for bit
  the pass of that one query at length lengths + t, blockwise and dense, for ragged rows, with and
  without a (traced) window, and equals the dense reference to rounding. XLA's dots and sums over these
  shapes round differently for T rows than for one: the blocks' score product, value product or sum
  done for all T queries at once (each tried alone) fails this test."""
  B, G, Hg, Dh, S, block = shape
  rng = np.random.default_rng(S)
  k, v = (jnp.asarray(rng.normal(size=(2, B, S, G, Dh)), dtype) for _ in range(2))
  config = tiny_model(0)[0].replace(head_dim=Dh, attn_softcap=softcap)

  @jax.jit
  def both(q, lengths_B, window):  # blockwise and dense
    return tuple(
        attention.attend(q, k, v, 1, Mask(lengths_B, window), config.replace(attention_block=size), per_query=True)[0]
        for size in (block, 0))

  for T in Ts:
    q = jnp.asarray(rng.normal(size=(B, T, G, Hg, Dh)), dtype)
    lengths_B = jnp.asarray(rng.integers(0, S - T + 1, size=B), jnp.int32)
    for window in (0, 5):
      chain = both(q, lengths_B, window)
      steps = [both(q[:, t:t + 1], lengths_B + t, window) for t in range(T)]
      for got, one_query in zip(chain, zip(*steps)):
        np.testing.assert_array_equal(np.asarray(got), np.concatenate(one_query, axis=1), f"T {T}, window {window}")
      as32 = lambda x: x.astype(jnp.float32)
      expected = attention.dense(as32(q), as32(k), as32(v), 1, Mask(lengths_B, window), None, softcap)
      np.testing.assert_allclose(as32(chain[0]), expected, rtol=1e-5, atol=1e-5 if dtype == jnp.float32 else 3e-2)


PROMPTS = [[5, 17, 3, 44, 9, 8, 1], [1, 2], [60, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.mark.parametrize("chunk, block", list(itertools.product([1, 3, 4, 11], [0, 4])))
def test_chunked_prefill_equals_one_shot(chunk, block):
  config, params = tiny_model(0, n_layers=2)
  padded, lengths = pad_prompts(PROMPTS)
  run = lambda cfg: jax.jit(prefill, static_argnums=0)(cfg, params, padded, lengths, init_cache(cfg, len(PROMPTS), 24))
  one_shot_logits, one_shot_cache = run(config.replace(prefill_chunk=padded.shape[1], attention_block=0))
  logits, cache = run(config.replace(prefill_chunk=chunk, attention_block=block))
  np.testing.assert_allclose(logits, one_shot_logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, lengths)
  for b, n in enumerate(lengths):  # committed positions hold the same keys and values
    np.testing.assert_allclose(cache.k[:, b, :n], one_shot_cache.k[:, b, :n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cache.v[:, b, :n], one_shot_cache.v[:, b, :n], rtol=1e-5, atol=1e-5)
