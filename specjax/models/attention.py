"""Grouped-query attention of a chunk of T queries over one layer's static KV cache.

Query t of row b sits at position `lengths[b] + t` and sees every key at a position <= its own (and,
with a sliding window W > 0, > its own - W). A tree chunk (`tree`: static, or per row) puts query t
at `lengths[b] + depth[t]` and lets it see the committed keys and its ancestors' slots (see
`visible`). W may be a traced scalar: under `scan_layers` each layer's window is looked up by the
scanned layer index (Gemma's sliding and global layers). Scores are q.k times `scale`, optionally
soft-capped (c tanh(s / c), Gemma 2) before the mask. Three implementations of that one function
(`attend` picks one):

- `dense` (`attention_block = 0`): the portable reference. Scores against all S_max cache positions,
  masked: cost and the float32 score tensor [B, G, Hg, T, S_max] grow with the cache's capacity,
  whatever the rows hold.
- `blockwise` (`attention_block = Sb`): walks key blocks of Sb positions with an online softmax (running
  max, running sum, float32 accumulator), only over the blocks that some row's queries can see: from
  the window's start (0 without a window) up to the batch's longest live length + T. Cost and memory
  follow what the rows hold; peak scores are [B, G, Hg, T, Sb]. The number of blocks is data: a
  `lax.fori_loop` with a dynamic trip count (on GPU each block costs one read of the loop predicate by
  the host; on CPU nothing). It is not reverse-differentiable: training uses `dense`.
- `kernel` (GPU): the committed prefix through JAX's Pallas decode kernel, the chunk's own keys densely,
  merged exactly: no data-dependent XLA loop (`kernel_attention`).

`dense` and `blockwise` read one layer of the stacked cache `[L, B, S, G, Dh]` by index: slicing the
layer out first would copy all of its S_max positions every pass (at S_max = 32k that copy cost more
than the live attention; the kernel's custom call needs that copy). All compute scores in float32 and
feed the softmax weights to the value product in the model dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.attention_mask import Mask, query_positions, scores, visible
from specjax.models.config import ModelConfig


def dense(q_BxTxGxHgxDh: jax.Array, k_LxBxSxGxDh: jax.Array, v_LxBxSxGxDh: jax.Array, layer, mask: Mask,
          scale: float | None = None, softcap: float = 0.0) -> jax.Array:
  """Attention output [B, T, G, Hg, Dh] over every cache position of `layer`, masked (the reference)."""
  lengths_B, window, tree = mask
  k_BxSxGxDh, v_BxSxGxDh = k_LxBxSxGxDh[layer], v_LxBxSxGxDh[layer]
  T, S = q_BxTxGxHgxDh.shape[1], k_BxSxGxDh.shape[1]
  query_pos_BxT = query_positions(lengths_B, T, tree)
  visible_BxTxS = visible(query_pos_BxT, jnp.arange(S)[None, :], window, lengths_B, tree)
  scale = q_BxTxGxHgxDh.shape[-1]**-0.5 if scale is None else scale
  scores_BxGxHgxTxS = jnp.where(visible_BxTxS[:, None, None], scores(q_BxTxGxHgxDh, k_BxSxGxDh, scale, softcap),
                                -jnp.inf)
  weights = jax.nn.softmax(scores_BxGxHgxTxS, axis=-1).astype(v_BxSxGxDh.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", weights, v_BxSxGxDh)


def _pairwise_sum(x_xN: jax.Array) -> jax.Array:
  """The sum over the last axis by halving it (zero-padded to a power of two) with elementwise adds: each
  element's order is fixed by N alone, where XLA's reductions sum in an order that depends on how many
  rows they reduce."""
  width = 1 << (x_xN.shape[-1] - 1).bit_length()
  x_xN = jnp.pad(x_xN, [(0, 0)] * (x_xN.ndim - 1) + [(0, width - x_xN.shape[-1])])
  while width > 1:
    width //= 2
    x_xN = x_xN[..., :width] + x_xN[..., width:]
  return x_xN[..., 0]


def _block_update(q_BxTxGxHgxDh: jax.Array, k_BxSbxGxDh: jax.Array, v_BxSbxGxDh: jax.Array, visible_BxTxSb: jax.Array,
                  carry: tuple, scale: float, softcap: float, per_query: bool) -> tuple:
  """One key block's online-softmax update of the queries' (max, sum, accumulator) [B, G, Hg, T(, Dh)].

  `per_query`: query t's arithmetic does not depend on T. XLA's dot kernels sum in an order that depends
  on how many rows they multiply, so the two products run on each query's slice (the shapes of T = 1);
  the block's sum is pairwise (`_pairwise_sum`); the rest is elementwise or a max, exact in any order."""
  max_BxGxHgxT, sum_BxGxHgxT, acc_BxGxHgxTxDh = carry
  T = q_BxTxGxHgxDh.shape[1]
  # `product` of x ([B, T, ...] at `axis` = 1 or [B, G, Hg, T, ...] at 3), query by query where per_query.
  each = lambda product, x, axis: (jnp.concatenate(
      [product(jax.lax.slice_in_dim(x, t, t + 1, axis=axis)) for t in range(T)], axis=3) if per_query else product(x))
  visible_Bx1x1xTxSb = visible_BxTxSb[:, None, None]
  scores_BxGxHgxTxSb = jnp.where(visible_Bx1x1xTxSb,
                                 each(lambda q: scores(q, k_BxSbxGxDh, scale, softcap), q_BxTxGxHgxDh, 1), -jnp.inf)
  new_max_BxGxHgxT = jnp.maximum(max_BxGxHgxT, scores_BxGxHgxTxSb.max(axis=-1))
  # A query that has seen no key yet keeps max = -inf: shift by 0 there so no inf - inf appears.
  shift_BxGxHgxT = jnp.where(jnp.isfinite(new_max_BxGxHgxT), new_max_BxGxHgxT, 0.0)
  rescale_BxGxHgxT = jnp.exp(max_BxGxHgxT - shift_BxGxHgxT)
  weights_BxGxHgxTxSb = jnp.where(visible_Bx1x1xTxSb, jnp.exp(scores_BxGxHgxTxSb - shift_BxGxHgxT[..., None]), 0.0)
  block_sum_BxGxHgxT = _pairwise_sum(weights_BxGxHgxTxSb) if per_query else weights_BxGxHgxTxSb.sum(axis=-1)
  sum_BxGxHgxT = sum_BxGxHgxT * rescale_BxGxHgxT + block_sum_BxGxHgxT
  value = lambda w_BxGxHgxTxSb: jnp.einsum("bkgtn,bnkd->bkgtd", w_BxGxHgxTxSb, v_BxSbxGxDh, preferred_element_type=jnp.
                                           float32)
  acc_BxGxHgxTxDh = (acc_BxGxHgxTxDh * rescale_BxGxHgxT[..., None] +
                     each(value, weights_BxGxHgxTxSb.astype(v_BxSbxGxDh.dtype), 3))
  return new_max_BxGxHgxT, sum_BxGxHgxT, acc_BxGxHgxTxDh


def blockwise(q_BxTxGxHgxDh: jax.Array, k_LxBxSxGxDh: jax.Array, v_LxBxSxGxDh: jax.Array, layer, mask: Mask, block: int,
              scoring: tuple[float | None, float] = (None, 0.0), per_query: bool = False) -> jax.Array:
  """Attention output [B, T, G, Hg, Dh] over the live key blocks of `layer` only (online softmax), and
  the cache's keys and values as they leave the loop (unchanged: write the next layer into these).
  `scoring` = (scale, soft-cap): scores are q.k times scale (None: Dh^-1/2), soft-capped (0: none).

  `per_query` (a chain): query t computes bit for bit what the same call with one query at length
  `lengths + t` computes (`transformer.per_position`: the CPU kernel's batch-invariant mode, whose
  one-token steps run per_query too): all T queries go through each block together, their arithmetic
  is a one-query update's (`_block_update`), and the blocks beyond a query's own leave its state
  exactly as it was (a block it sees nothing of rescales by exp(0) = 1 and adds zeros)."""
  lengths_B, window, tree = mask
  B, T, G, Hg, Dh = q_BxTxGxHgxDh.shape
  S = k_LxBxSxGxDh.shape[2]
  block = min(block, S)
  scale, softcap = scoring
  scale = Dh**-0.5 if scale is None else scale
  query_pos_BxT = query_positions(lengths_B, T, tree)
  # One past the last key any query sees (a tree level also sees the `first` nodes before it).
  end = jnp.minimum(jnp.max(lengths_B) + T + (0 if tree is None else tree.first), S)
  start = jnp.where(window > 0, jnp.maximum(jnp.min(lengths_B) - window + 1, 0), 0)
  first_block, last_block = start // block, (end + block - 1) // block

  def step(i, carry):
    *state, k_LxBxSxGxDh, v_LxBxSxGxDh = carry
    # The last block may overhang S_max: it is read from S - block and its keys below i * block (already
    # seen by the previous block) are masked.
    begin = jnp.minimum(i * block, S - block)
    key_pos_Sb = begin + jnp.arange(block)
    start, size = (layer, 0, begin, 0, 0), (1, B, block, G, Dh)
    k_BxSbxGxDh = jax.lax.dynamic_slice(k_LxBxSxGxDh, start, size)[0]
    v_BxSbxGxDh = jax.lax.dynamic_slice(v_LxBxSxGxDh, start, size)[0]
    visible_BxTxSb = (visible(query_pos_BxT, key_pos_Sb[None, :], window, lengths_B, tree) &
                      (key_pos_Sb >= i * block)[None, None, :])
    state = _block_update(q_BxTxGxHgxDh, k_BxSbxGxDh, v_BxSbxGxDh, visible_BxTxSb, tuple(state), scale, softcap,
                          per_query)
    return (*state, k_LxBxSxGxDh, v_LxBxSxGxDh)

  # The cache rides in the carry and comes back out: the next write then updates the loop's own buffer
  # in place. Closed over instead, it is a loop invariant that XLA copies whole (every layer's
  # positions) before each layer's loop, since the write after the loop would clobber it.
  init = (jnp.full((B, G, Hg, T), -jnp.inf, jnp.float32), jnp.zeros(
      (B, G, Hg, T), jnp.float32), jnp.zeros((B, G, Hg, T, Dh), jnp.float32), k_LxBxSxGxDh, v_LxBxSxGxDh)
  _, sum_BxGxHgxT, acc_BxGxHgxTxDh, k_LxBxSxGxDh, v_LxBxSxGxDh = jax.lax.fori_loop(first_block, last_block, step, init)
  # Every query sees at least its own key, so the sum is > 0.
  out_BxGxHgxTxDh = acc_BxGxHgxTxDh / sum_BxGxHgxT[..., None]
  return out_BxGxHgxTxDh.transpose(0, 3, 1, 2, 4).astype(v_LxBxSxGxDh.dtype), k_LxBxSxGxDh, v_LxBxSxGxDh


def attend(q_BxTxGxHgxDh: jax.Array, k_LxBxSxGxDh: jax.Array, v_LxBxSxGxDh: jax.Array, layer, mask: Mask,
           config: ModelConfig, per_query: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Attention over cache layer `layer` (an int or a traced index; `mask.window` an int or a traced
  scalar, `mask.tree` static or None) by the config's implementation (`config.attention`, one of
  `config.ATTENTION_IMPLEMENTATIONS`): `dense`; `blockwise` with `config.attention_block` keys per step
  (`dense` when it is 0); the Pallas GPU kernel (`kernel_attention`; `kernel_interpret`: in interpret
  mode), which has no soft-cap and tiles heads in powers of two on GPU: soft-capped layers and heads of
  another width run blockwise. Scores are scaled by `config.attention_scale()` and soft-capped by
  `config.attn_softcap`. Returns the output [B, T, G, Hg, Dh] and the cache's keys and values to write
  the next layer into (see `blockwise`). `per_query` (a chain, blockwise or dense): each query computes
  bit for bit what the same call with that one query at its position computes (`blockwise`)."""
  implementation, block = config.attention, config.attention_block
  scale, softcap = config.attention_scale(), config.attn_softcap
  head_width = q_BxTxGxHgxDh.shape[-1]
  kernel_fits = not softcap and (implementation == "kernel_interpret" or head_width & (head_width - 1) == 0)
  if implementation.startswith("kernel") and kernel_fits:
    from specjax.models import kernel_attention  # imports Pallas: only where the kernel runs
    return (kernel_attention.kernel(q_BxTxGxHgxDh, k_LxBxSxGxDh, v_LxBxSxGxDh, layer, mask, scale,
                                    interpret=implementation == "kernel_interpret"), k_LxBxSxGxDh, v_LxBxSxGxDh)
  if block and implementation != "dense":
    return blockwise(q_BxTxGxHgxDh, k_LxBxSxGxDh, v_LxBxSxGxDh, layer, mask, block, (scale, softcap), per_query)
  if per_query:  # dense: query t as a one-token step at length lengths + t
    lengths_B, window, _ = mask
    return (jnp.concatenate([
        dense(q_BxTxGxHgxDh[:, t:t + 1], k_LxBxSxGxDh, v_LxBxSxGxDh, layer, Mask(lengths_B + t, window, None), scale,
              softcap) for t in range(q_BxTxGxHgxDh.shape[1])
    ], axis=1), k_LxBxSxGxDh, v_LxBxSxGxDh)
  return (dense(q_BxTxGxHgxDh, k_LxBxSxGxDh, v_LxBxSxGxDh, layer, mask, scale, softcap), k_LxBxSxGxDh, v_LxBxSxGxDh)
