"""The static KV cache: preallocated key/value arrays plus per-row lengths, an explicit pytree.

A forward pass writes its chunk of T keys/values at each row's own offset `lengths[b]` but does not
advance `lengths`; the caller commits what it keeps with `advance`. Rolling back a rejected suffix is
therefore free: the row's length does not move and the attention mask hides whatever lies beyond it,
to be overwritten by the next write. After a tree verify pass, `compact` gathers the accepted path into
contiguous slots before the caller advances.
"""

from __future__ import annotations

from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig

KERNEL_TILE = 16  # kernel attention's key tile (`kernel_attention`): its caches hold a multiple of it


class CacheSharding(Protocol):
  """Where a cache's arrays lie on the ambient mesh (`jax.set_mesh`). The caller makes it from the mesh
  and the model's partition rules, which this package does not know. A hashable value: the cache keeps
  it as a static field, so equal shardings share compiled programs."""
  def kv(self, x_LxBxSxGxDh: jax.Array) -> jax.Array:
    """`x` (keys or values of every layer) pinned where the cache's keys and values lie."""

  def rows(self, x_B: jax.Array) -> jax.Array:
    """`x` (the row lengths) pinned where the cache's rows lie."""


@flax.struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S_max, G, Dh] keys of every layer
  v: jax.Array  # [L, B, S_max, G, Dh] values of every layer
  lengths: jax.Array  # [B] int32: committed tokens per row (= position of the row's next token)
  # Static: where k/v lie on the mesh, None on one device. Every write pins the arrays there, so a
  # loop carrying the cache never moves it between devices.
  sharding: CacheSharding | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def max_len(self) -> int:
    """S_max, static: the number of positions each row can hold."""
    return self.k.shape[2]

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  def _with_kv(self, k: jax.Array, v: jax.Array) -> "KVCache":
    """The cache holding keys `k` and values `v` [L, B, S_max, G, Dh], pinned by `sharding`."""
    if self.sharding is None:
      return self.replace(k=k, v=v)
    return self.replace(k=self.sharding.kv(k), v=self.sharding.kv(v))

  def advance(self, num_tokens_B: jax.Array) -> "KVCache":
    """Commits `num_tokens_B[b]` more of the tokens last written to row b."""
    return self.replace(lengths=self.lengths + num_tokens_B.astype(jnp.int32))

  def write(self, layer: int, k_BxTxGxDh: jax.Array, v_BxTxGxDh: jax.Array, offset: int = 0) -> "KVCache":
    """Writes one layer's chunk of T keys/values at each row's own offset `lengths[b]` (+ `offset`,
    static: a tree level after the levels above it).

    A scatter straight into the stacked arrays, so XLA updates them in place (slicing out the
    layer and setting it back copied the whole cache per layer: 3x slower decode at S=2048).
    Positions past S_max are dropped, never clamped onto valid entries; callers check capacity.
    """
    T = k_BxTxGxDh.shape[1]
    positions_BxT = self.lengths[:, None] + (offset + jnp.arange(T))[None, :]
    layer_BxT = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), positions_BxT.shape)
    indices_BxTx2 = jnp.stack([layer_BxT, positions_BxT], axis=-1)
    return self._with_kv(_scatter_rows(self.k, indices_BxTx2, k_BxTxGxDh),
                         _scatter_rows(self.v, indices_BxTx2, v_BxTxGxDh))

  def compact(self, source_BxM: jax.Array) -> "KVCache":
    """Moves each row's keys/values from slots `lengths[b] + source[b, j]` to `lengths[b] + j` (every
    layer), j < M: after a tree verify pass, the accepted path (node indices, ascending, source[b, j] >= j)
    becomes contiguous, ready to `advance`. Reads all M sources before writing, so overlapping moves are
    safe. A chain's path is the identity: callers skip this statically for chains."""
    M = source_BxM.shape[1]
    targets_BxM = self.lengths[:, None] + jnp.arange(M)[None, :]
    sources_BxM = self.lengths[:, None] + source_BxM.astype(jnp.int32)
    L, _, _, G, Dh = self.k.shape

    def move(cache_LxBxSxGxDh):
      moved_BxMxLxGxDh = jax.lax.gather(cache_LxBxSxGxDh, sources_BxM[..., None], _ROW_GATHER, (L, 1, 1, G, Dh),
                                        mode=jax.lax.GatherScatterMode.CLIP)
      return jax.lax.scatter(cache_LxBxSxGxDh, targets_BxM[..., None], moved_BxMxLxGxDh, _ROW_MOVE, unique_indices=True,
                             mode=jax.lax.GatherScatterMode.FILL_OR_DROP)

    return self._with_kv(move(self.k), move(self.v))


# Row b's updates go to its own row of the cache: the rows are a batching dimension of the scatter (and
# of the gather in `compact`), so XLA writes in place in the [L, B, S, G, Dh] layout and GSPMD keeps each
# row's update on its own device. (A vmap over the rows moved B in front: two transposes of the whole
# stacked cache per layer and write at B > 1; indexing the rows explicitly gathered every update over the
# data axis of a mesh.)
_ROW_SCATTER = jax.lax.ScatterDimensionNumbers(update_window_dims=(2, 3), inserted_window_dims=(0, 2),
                                               scatter_dims_to_operand_dims=(0, 2), operand_batching_dims=(1,),
                                               scatter_indices_batching_dims=(0,))
# `compact`: every layer's slot `indices[b, m]` of row b, read as [B, M, L, G, Dh] and written back.
_ROW_GATHER = jax.lax.GatherDimensionNumbers(offset_dims=(2, 3, 4), collapsed_slice_dims=(2,), start_index_map=(2,),
                                             operand_batching_dims=(1,), start_indices_batching_dims=(0,))
_ROW_MOVE = jax.lax.ScatterDimensionNumbers(update_window_dims=(2, 3, 4), inserted_window_dims=(2,),
                                            scatter_dims_to_operand_dims=(2,), operand_batching_dims=(1,),
                                            scatter_indices_batching_dims=(0,))


def _scatter_rows(cache_LxBxSxGxDh: jax.Array, indices_BxTx2: jax.Array, updates_BxTxGxDh: jax.Array) -> jax.Array:
  """`cache[indices[b, t, 0], b, indices[b, t, 1]] = updates[b, t]` for every row b and t; indices past
  the cache are dropped."""
  return jax.lax.scatter(cache_LxBxSxGxDh, indices_BxTx2, updates_BxTxGxDh.astype(cache_LxBxSxGxDh.dtype), _ROW_SCATTER,
                         indices_are_sorted=False, unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def init_cache(config: ModelConfig, batch_size: int, max_len: int, sharding: CacheSharding | None = None) -> KVCache:
  """An empty cache for `batch_size` rows of up to `max_len` positions (both static; rounded up to the
  kernel attention's tile when `config.attention` is a kernel), laid out by `sharding` on the mesh set
  by `jax.set_mesh` (which must be set): each device allocates only its own shard. None: no placement
  asked for (one device)."""
  if config.attention.startswith("kernel"):
    max_len = -(-max_len // KERNEL_TILE) * KERNEL_TILE
  shape = (config.n_layers, batch_size, max_len, config.n_kv_heads, config.head_dim)

  def empty():
    zeros = lambda: jnp.zeros(shape, config.cache_dtype)  # k and v: two buffers
    lengths = jnp.zeros((batch_size,), jnp.int32)
    if sharding is None:
      return KVCache(k=zeros(), v=zeros(), lengths=lengths)
    return KVCache(k=sharding.kv(zeros()), v=sharding.kv(zeros()), lengths=sharding.rows(lengths), sharding=sharding)

  if sharding is None:
    return empty()
  if jax.sharding.get_abstract_mesh().empty:
    raise ValueError(f"init_cache: {sharding} lays the cache out on a mesh, but none is set (jax.set_mesh)")
  return jax.jit(empty)()
