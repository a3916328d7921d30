"""Grouped-query attention of a chunk of T queries over one layer's static KV cache.

Query t of row b sits at position `lengths[b] + t` and sees every key at a position <= its own (and,
with a sliding window W > 0, > its own - W). A tree chunk (`tree`: static, or per row) puts query t
at `lengths[b] + depth[t]` and lets it see the committed keys and its ancestors' slots (see `_visible`). W may be a traced scalar: under `scan_layers` each layer's
window is looked up by the scanned layer index (Gemma's sliding and global layers). Scores are q.k
times `scale`, optionally soft-capped (c tanh(s / c), Gemma 2) before the mask. Two implementations of
that one function:

- `dense` (`attention_block = 0`): the portable reference. Scores against all S_max cache positions,
  masked: cost and the float32 score tensor [B, H_kv, G, T, S_max] grow with the cache's capacity,
  whatever the rows hold.
- `blockwise` (`attention_block = N`): walks key blocks of N positions with an online softmax (running
  max, running sum, float32 accumulator), only over the blocks that some row's queries can see: from
  the window's start (0 without a window) up to the batch's longest live length + T. Cost and memory
  follow what the rows hold; peak scores are [B, H_kv, G, T, N]. The number of blocks is data: a
  `lax.fori_loop` with a dynamic trip count (on GPU each block costs one read of the loop predicate by
  the host; on CPU nothing). It is not reverse-differentiable: training uses `dense`.

Both read one layer of the stacked cache `[L, B, S, H_kv, D]` by index: slicing the layer out first
would copy all of its S_max positions every pass (at S_max = 32k that copy cost more than the live
attention). Both compute scores in float32 and feed the softmax weights to the value product in the
model dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def query_positions(lengths_B: jax.Array, T: int, tree=None) -> jax.Array:
  """[B, T] int32 positions of a chunk's tokens: `lengths[b] + t` for a chain, `lengths[b] + depth[t]`
  for a tree chunk: an object with a static int `first` and `depth`, `key_depth`, `ancestor_mask()`,
  either static (a `speculative.tree.Tree` or one level of it, `TreeLevel`: tuples / numpy, shared
  by every row) or per row (`speculative.dynamic_tree`: arrays with a leading [B] axis)."""
  if tree is None:
    return lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  return lengths_B[:, None] + per_row(tree.depth, lengths_B.shape[0], 1)


def per_row(table, batch: int, dims: int) -> jax.Array:
  """A tree table as [B, ...]: a static one (`dims` axes, shared by every row) broadcast, a per-row one
  (a leading [B] axis) as it is."""
  table = jnp.asarray(table)
  table = table.astype(jnp.int32) if table.dtype != bool else table
  return jnp.broadcast_to(table, (batch,) + table.shape[-dims:]) if table.ndim == dims else table


def _in_window(query_pos_BxT: jax.Array, key_pos_xS: jax.Array, window) -> jax.Array | bool:
  """[B, T, S] True where a key (positions [B or 1, S]) lies inside the sliding window of a query
  (`window` an int or a traced scalar; 0 = no window: True)."""
  if isinstance(window, int) and not window:
    return True
  return (key_pos_xS[:, None, :] > query_pos_BxT[:, :, None] - window) | (window <= 0)


def _visible(query_pos_BxT: jax.Array, key_pos_S: jax.Array, window, lengths_B: jax.Array,
             tree=None) -> jax.Array:
  """[B, T, S] True where query t may attend to the key in cache slot key_pos.

  Chain: the key's position is its slot; causal (<= the query's position) and in the window.
  Tree: slot `lengths[b] + j` holds tree node j, at position `lengths[b] + key_depth[j]`, for j below
  `first + T` (the chunk's nodes follow the `first` ones fed before); a query sees the committed slots
  below `lengths[b]` and the slots of its ancestors (itself included; `ancestor_mask()` [T, first + T]),
  each in the window measured from its position."""
  if tree is None:
    visible_BxTxS = key_pos_S[None, None, :] <= query_pos_BxT[:, :, None]
    return visible_BxTxS & _in_window(query_pos_BxT, key_pos_S[None, :], window)
  width = tree.first + query_pos_BxT.shape[1]
  slot_BxS = key_pos_S[None, :] - lengths_B[:, None]  # the tree node a slot holds, if 0 <= slot < width
  in_chunk_BxS = (slot_BxS >= 0) & (slot_BxS < width)
  index_BxS = jnp.clip(slot_BxS, 0, width - 1)
  batch = lengths_B.shape[0]
  ancestor_BxTxS = jnp.take_along_axis(per_row(tree.ancestor_mask(), batch, 2), index_BxS[:, None, :], axis=2)
  key_depth_BxS = jnp.take_along_axis(per_row(tree.key_depth, batch, 1), index_BxS, axis=1)
  key_pos_BxS = jnp.where(in_chunk_BxS, lengths_B[:, None] + key_depth_BxS, key_pos_S[None, :])
  visible_BxTxS = jnp.where(in_chunk_BxS[:, None, :], ancestor_BxTxS, (slot_BxS < 0)[:, None, :])
  return visible_BxTxS & _in_window(query_pos_BxT, key_pos_BxS, window)


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(x / cap): Gemma 2's smooth bound on attention scores and logits; `x` when cap is 0."""
  return cap * jnp.tanh(x / cap) if cap else x


def _scores(q_BxTxKxGxD: jax.Array, k_BxSxKxD: jax.Array, scale: float, softcap: float) -> jax.Array:
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD, preferred_element_type=jnp.float32) * scale
  return soft_cap(scores, softcap)


def dense(q_BxTxKxGxD: jax.Array, k_LxBxSxKxD: jax.Array, v_LxBxSxKxD: jax.Array, layer, lengths_B: jax.Array,
          window, scale: float | None = None, softcap: float = 0.0, tree=None) -> jax.Array:
  """Attention output [B, T, H_kv, G, D] over every cache position of `layer`, masked (the reference)."""
  k_BxSxKxD, v_BxSxKxD = k_LxBxSxKxD[layer], v_LxBxSxKxD[layer]
  T, S = q_BxTxKxGxD.shape[1], k_BxSxKxD.shape[1]
  query_pos_BxT = query_positions(lengths_B, T, tree)
  visible_BxTxS = _visible(query_pos_BxT, jnp.arange(S), window, lengths_B, tree)
  scale = q_BxTxKxGxD.shape[-1] ** -0.5 if scale is None else scale
  scores_BxKxGxTxS = jnp.where(visible_BxTxS[:, None, None], _scores(q_BxTxKxGxD, k_BxSxKxD, scale, softcap),
                               -jnp.inf)
  weights = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(v_BxSxKxD.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", weights, v_BxSxKxD)


def blockwise(q_BxTxKxGxD: jax.Array, k_LxBxSxKxD: jax.Array, v_LxBxSxKxD: jax.Array, layer,
              lengths_B: jax.Array, window, block: int, scale: float | None = None,
              softcap: float = 0.0, tree=None) -> jax.Array:
  """Attention output [B, T, H_kv, G, D] over the live key blocks of `layer` only (online softmax)."""
  B, T, K, G, D = q_BxTxKxGxD.shape
  S = k_LxBxSxKxD.shape[2]
  block = min(block, S)
  scale = D ** -0.5 if scale is None else scale
  query_pos_BxT = query_positions(lengths_B, T, tree)
  # One past the last key any query sees (a tree level also sees the `first` nodes before it).
  end = jnp.minimum(jnp.max(lengths_B) + T + (0 if tree is None else tree.first), S)
  start = jnp.where(window > 0, jnp.maximum(jnp.min(lengths_B) - window + 1, 0), 0)
  first_block, last_block = start // block, (end + block - 1) // block

  def step(i, carry):
    max_BxKxGxT, sum_BxKxGxT, acc_BxKxGxTxD = carry
    # The last block may overhang S_max: it is read from S - block and its keys below i * block (already
    # seen by the previous block) are masked.
    begin = jnp.minimum(i * block, S - block)
    key_pos_N = begin + jnp.arange(block)
    start, size = (layer, 0, begin, 0, 0), (1, B, block, K, D)
    k_BxNxKxD = jax.lax.dynamic_slice(k_LxBxSxKxD, start, size)[0]
    v_BxNxKxD = jax.lax.dynamic_slice(v_LxBxSxKxD, start, size)[0]
    visible_BxTxN = (_visible(query_pos_BxT, key_pos_N, window, lengths_B, tree)
                     & (key_pos_N >= i * block)[None, None, :])
    visible_Bx1x1xTxN = visible_BxTxN[:, None, None]
    scores_BxKxGxTxN = jnp.where(visible_Bx1x1xTxN, _scores(q_BxTxKxGxD, k_BxNxKxD, scale, softcap), -jnp.inf)
    new_max_BxKxGxT = jnp.maximum(max_BxKxGxT, scores_BxKxGxTxN.max(axis=-1))
    # A query that has seen no key yet keeps max = -inf: shift by 0 there so no inf - inf appears.
    shift_BxKxGxT = jnp.where(jnp.isfinite(new_max_BxKxGxT), new_max_BxKxGxT, 0.0)
    rescale_BxKxGxT = jnp.exp(max_BxKxGxT - shift_BxKxGxT)
    weights_BxKxGxTxN = jnp.where(visible_Bx1x1xTxN, jnp.exp(scores_BxKxGxTxN - shift_BxKxGxT[..., None]), 0.0)
    sum_BxKxGxT = sum_BxKxGxT * rescale_BxKxGxT + weights_BxKxGxTxN.sum(axis=-1)
    acc_BxKxGxTxD = acc_BxKxGxTxD * rescale_BxKxGxT[..., None] + jnp.einsum(
        "bkgtn,bnkd->bkgtd", weights_BxKxGxTxN.astype(v_LxBxSxKxD.dtype), v_BxNxKxD,
        preferred_element_type=jnp.float32)
    return new_max_BxKxGxT, sum_BxKxGxT, acc_BxKxGxTxD

  init = (jnp.full((B, K, G, T), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
          jnp.zeros((B, K, G, T, D), jnp.float32))
  _, sum_BxKxGxT, acc_BxKxGxTxD = jax.lax.fori_loop(first_block, last_block, step, init)
  # Every query sees at least its own key, so the sum is > 0.
  out_BxKxGxTxD = acc_BxKxGxTxD / sum_BxKxGxT[..., None]
  return out_BxKxGxTxD.transpose(0, 3, 1, 2, 4).astype(v_LxBxSxKxD.dtype)


def attend(q_BxTxKxGxD: jax.Array, k_LxBxSxKxD: jax.Array, v_LxBxSxKxD: jax.Array, layer, lengths_B: jax.Array,
           window, block: int, scale: float | None = None, softcap: float = 0.0, tree=None) -> jax.Array:
  """`blockwise` with `block` keys per step, or `dense` when `block` is 0, over cache layer `layer` (an
  int or a traced index) with `window` (an int or a traced scalar); `scale` defaults to D^(-1/2);
  `tree` (static, None = a chain) makes the chunk a tree (see `_visible`)."""
  if block:
    return blockwise(q_BxTxKxGxD, k_LxBxSxKxD, v_LxBxSxKxD, layer, lengths_B, window, block, scale, softcap,
                     tree)
  return dense(q_BxTxKxGxD, k_LxBxSxKxD, v_LxBxSxKxD, layer, lengths_B, window, scale, softcap, tree)
