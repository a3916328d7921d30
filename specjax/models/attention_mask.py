"""What a query of an attention chunk sees and how it scores a key: the mask (causal, sliding window, a
tree chunk's ancestors) and the capped scores, shared by the XLA attention (`attention`) and the Pallas
kernel (`kernel_attention`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Mask(NamedTuple):
  """What a chunk's queries see (`visible`): each row's committed length [B], the sliding window (an int
  or a traced scalar; 0 = none) and the chunk's tree (static or per row; None = a chain)."""

  lengths_B: jax.Array
  window: Any = 0
  tree: Any = None


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


def visible(query_pos_BxT: jax.Array, key_slot_xS: jax.Array, window, lengths_B: jax.Array, tree=None) -> jax.Array:
  """[B, T, S] True where query t may attend to the key in cache slot `key_slot_xS` ([1, S]: the same
  slots for every row, or [B, S]: each row its own).

  Chain: the key's position is its slot; causal (<= the query's position) and in the window.
  Tree: slot `lengths[b] + j` holds tree node j, at position `lengths[b] + key_depth[j]`, for j below
  `first + T` (the chunk's nodes follow the `first` ones fed before); a query sees the committed slots
  below `lengths[b]` and the slots of its ancestors (itself included; `ancestor_mask()` [T, first + T]),
  each in the window measured from its position."""
  if tree is None:
    visible_BxTxS = key_slot_xS[:, None, :] <= query_pos_BxT[:, :, None]
    return visible_BxTxS & _in_window(query_pos_BxT, key_slot_xS, window)
  width = tree.first + query_pos_BxT.shape[1]
  slot_BxS = key_slot_xS - lengths_B[:, None]  # the tree node a slot holds, if 0 <= slot < width
  in_chunk_BxS = (slot_BxS >= 0) & (slot_BxS < width)
  index_BxS = jnp.clip(slot_BxS, 0, width - 1)
  batch = lengths_B.shape[0]
  ancestor_BxTxS = jnp.take_along_axis(per_row(tree.ancestor_mask(), batch, 2), index_BxS[:, None, :], axis=2)
  key_depth_BxS = jnp.take_along_axis(per_row(tree.key_depth, batch, 1), index_BxS, axis=1)
  key_pos_BxS = jnp.where(in_chunk_BxS, lengths_B[:, None] + key_depth_BxS, key_slot_xS)
  visible_BxTxS = jnp.where(in_chunk_BxS[:, None, :], ancestor_BxTxS, (slot_BxS < 0)[:, None, :])
  return visible_BxTxS & _in_window(query_pos_BxT, key_pos_BxS, window)


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(x / cap): Gemma 2's smooth bound on attention scores and logits; `x` when cap is 0."""
  return cap * jnp.tanh(x / cap) if cap else x


def scores(q_BxTxGxHgxDh: jax.Array, k_BxSxGxDh: jax.Array, scale: float, softcap: float) -> jax.Array:
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BxTxGxHgxDh, k_BxSxGxDh, preferred_element_type=jnp.float32) * scale
  return soft_cap(scores, softcap)
