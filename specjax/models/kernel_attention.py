"""Live-length attention through JAX's Pallas GPU decode kernel: no data-dependent XLA loop per layer.

The same function as `attention.dense` (see `attention`), split by key slots so that each part is a
fixed-shape computation:
- **the shared prefix**, slots [start_b, lengths_b): committed keys that every query of the chunk sees
  (all of them without a sliding window; with window W, those inside the window of the chunk's last
  possible position: start_b = lengths_b + first + T - W). They go through
  `jax.experimental.pallas.ops.gpu.decode_attention.gqa`, ragged over the per-row ranges and split-K;
  the chunk's T queries share the range, so they are folded into the kernel's query-head axis
  (T x Hg queries per key/value head). Its trip count lives inside the kernel (a Triton custom call on
  GPU), not in XLA.
- **the rest**, a few slots gathered per row: the chunk's own first + T slots (a causal chain, or a
  tree's ancestors) and, with a window, the first + T - 1 slots at the window's edge that only some
  queries see; scored densely with the exact mask (`attention_mask.visible`).
The two partial softmaxes are merged exactly through their maxima and sums.

The kernel reads the cache's layer as [B, G, S, Dh] (a copy of the layer's S_max positions that XLA
makes for the custom call: bandwidth that follows the capacity, not the live length). It has no
soft-cap, and Triton tiles a head in a power of two: Gemma 2's soft-capped layers and heads of another
width fall back to blockwise (`attention.attend`). Its tiles need
S_max to be a multiple of `TILE` (`kv_cache.init_cache` rounds up). On CPU it runs in Pallas interpret
mode (tests): the same kernel, emulated by XLA loops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import decode_attention

from specjax.models import attention_mask
from specjax.models.kv_cache import KERNEL_TILE as TILE  # the kernel's smallest key tile


def tiling(S: int) -> tuple[int, int]:
  """(k_splits, block_k) for a cache of S slots (a multiple of TILE): the most key splits (run in
  parallel) up to the kernel's default 16 whose share is a multiple of TILE, and the widest block of
  keys per inner step up to its default 128 that divides a share."""
  if S % TILE:
    raise ValueError(f"kernel attention needs a cache capacity that is a multiple of {TILE}, got {S}")
  splits = next(n for n in (16, 8, 4, 2, 1) if S % (n * TILE) == 0)
  return splits, next(b for b in (128, 64, 32, 16) if (S // splits) % b == 0)


def kernel(q_BxTxGxHgxDh: jax.Array, k_LxBxSxGxDh: jax.Array, v_LxBxSxGxDh: jax.Array, layer, mask: attention_mask.Mask,
           scale: float | None = None, interpret: bool = False) -> jax.Array:
  """Attention output [B, T, G, Hg, Dh] of `attention.dense` (no soft-cap) over cache layer `layer`;
  `interpret` runs the kernel in Pallas interpret mode (any backend)."""
  lengths_B, window, tree = mask
  B, T, G, Hg, Dh = q_BxTxGxHgxDh.shape
  S = k_LxBxSxGxDh.shape[2]
  scale = Dh**-0.5 if scale is None else scale
  width = T + (0 if tree is None else tree.first)  # the chunk's slots, from lengths_B
  windowed = not (isinstance(window, int) and window == 0)
  window_scalar = jnp.asarray(window, jnp.int32)
  start_B = (jnp.where(window_scalar > 0, jnp.clip(lengths_B + width - window_scalar, 0, lengths_B), 0)
             if windowed else jnp.zeros_like(lengths_B))
  layer_k_BxSxGxDh = jax.lax.dynamic_index_in_dim(k_LxBxSxGxDh, layer, axis=0, keepdims=False)
  layer_v_BxSxGxDh = jax.lax.dynamic_index_in_dim(v_LxBxSxGxDh, layer, axis=0, keepdims=False)

  # The rest, as parts (owned slots [lo, hi), slots read): the window's edge [max(lengths - W + 1, 0),
  # start) (fewer than `width` slots), then the chunk. A part that would overhang S_max reads a window
  # shifted inside it; the slots it does not own are masked.
  parts = [(lengths_B, lengths_B + width, width)]
  if windowed and width > 1:
    edge_start_B = jnp.where(window_scalar > 0, jnp.maximum(lengths_B - window_scalar + 1, 0), start_B)
    parts.insert(0, (edge_start_B, start_B, width - 1))
  slots = [jnp.clip(lo_B, 0, S - n)[:, None] + jnp.arange(n)[None, :] for lo_B, _, n in parts]
  slot_BxSe = jnp.concatenate(slots, axis=1)
  owned_BxSe = jnp.concatenate([
      (slot_BxN >= lo_B[:, None]) & (slot_BxN < hi_B[:, None]) for slot_BxN, (lo_B, hi_B, _) in zip(slots, parts)
  ], axis=1)
  k_BxSexGxDh = jnp.take_along_axis(layer_k_BxSxGxDh, slot_BxSe[:, :, None, None], axis=1)
  v_BxSexGxDh = jnp.take_along_axis(layer_v_BxSxGxDh, slot_BxSe[:, :, None, None], axis=1)
  query_pos_BxT = attention_mask.query_positions(lengths_B, T, tree)
  visible_BxTxSe = owned_BxSe[:, None, :] & attention_mask.visible(query_pos_BxT, slot_BxSe, window, lengths_B, tree)
  scores_BxGxHgxTxSe = jnp.where(visible_BxTxSe[:, None, None],
                                 attention_mask.scores(q_BxTxGxHgxDh, k_BxSexGxDh, scale, 0.0), -jnp.inf)
  rest_max_BxGxHgxT = scores_BxGxHgxTxSe.max(axis=-1)  # finite: every query sees its own slot
  weights_BxGxHgxTxSe = jnp.exp(scores_BxGxHgxTxSe - rest_max_BxGxHgxT[..., None])
  rest_sum_BxGxHgxT = weights_BxGxHgxTxSe.sum(axis=-1)
  rest_acc_BxGxHgxTxDh = jnp.einsum("bkgts,bskd->bkgtd", weights_BxGxHgxTxSe.astype(v_LxBxSxGxDh.dtype), v_BxSexGxDh,
                                    preferred_element_type=jnp.float32)

  # The shared prefix through the kernel: queries [B, G * T * Hg, Dh], unnormalised output with its
  # running max and sum (a row whose range is empty gives sum 0, max = float32's lowest: weight 0 below).
  splits, block = tiling(S)
  q_BxQxDh = q_BxTxGxHgxDh.transpose(0, 2, 1, 3, 4).reshape(B, G * T * Hg, Dh)
  acc_BxQxDh, (sum_BxQ, max_BxQ) = decode_attention.gqa(q_BxQxDh, layer_k_BxSxGxDh, layer_v_BxSxGxDh, start_B,
                                                        lengths_B, sm_scale=scale, k_splits=splits, block_k=block,
                                                        interpret=interpret, return_residuals=True,
                                                        normalize_output=False)
  fold = lambda x: x.reshape(B, G, T, Hg, *x.shape[2:]).swapaxes(2, 3)  # -> [B, G, Hg, T, ...]
  prefix_acc_BxGxHgxTxDh, prefix_sum_BxGxHgxT, prefix_max_BxGxHgxT = fold(acc_BxQxDh), fold(sum_BxQ), fold(max_BxQ)

  max_BxGxHgxT = jnp.maximum(prefix_max_BxGxHgxT, rest_max_BxGxHgxT)
  prefix_w_BxGxHgxT = jnp.exp(prefix_max_BxGxHgxT - max_BxGxHgxT)
  rest_w_BxGxHgxT = jnp.exp(rest_max_BxGxHgxT - max_BxGxHgxT)
  total_BxGxHgxT = prefix_sum_BxGxHgxT * prefix_w_BxGxHgxT + rest_sum_BxGxHgxT * rest_w_BxGxHgxT
  out_BxGxHgxTxDh = (prefix_acc_BxGxHgxTxDh.astype(jnp.float32) * prefix_w_BxGxHgxT[..., None] +
                     rest_acc_BxGxHgxTxDh * rest_w_BxGxHgxT[..., None]) / total_BxGxHgxT[..., None]
  return out_BxGxHgxTxDh.transpose(0, 3, 1, 2, 4).astype(v_LxBxSxGxDh.dtype)
