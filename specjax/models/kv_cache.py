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

    # One row's write, vmapped over the rows: a scatter whose rows are a batch dimension, which
    # GSPMD keeps on each row's own device (indexing the rows explicitly gathered every update
    # over the data axis).
    def write_row(cache_LxSxGxDh, positions_T, update_TxGxDh):
      return cache_LxSxGxDh.at[layer, positions_T].set(update_TxGxDh.astype(cache_LxSxGxDh.dtype), mode="drop")

    write = jax.vmap(write_row, in_axes=(1, 0, 0), out_axes=1)
    return self._with_kv(write(self.k, positions_BxT, k_BxTxGxDh), write(self.v, positions_BxT, v_BxTxGxDh))

  def compact(self, source_BxM: jax.Array) -> "KVCache":
    """Moves each row's keys/values from slots `lengths[b] + source[b, j]` to `lengths[b] + j` (every
    layer), j < M: after a tree verify pass, the accepted path (node indices, ascending, source[b, j] >= j)
    becomes contiguous, ready to `advance`. Reads all M sources before writing, so overlapping moves are
    safe. A chain's path is the identity: callers skip this statically for chains."""
    M = source_BxM.shape[1]
    targets_BxM = self.lengths[:, None] + jnp.arange(M)[None, :]
    sources_BxM = self.lengths[:, None] + source_BxM.astype(jnp.int32)

    # Vmapped over the rows like `write`: each row moves its own slots, on its own device.
    def move_row(cache_LxSxGxDh, sources_M, targets_M):
      moved_LxMxGxDh = jnp.take(cache_LxSxGxDh, sources_M, axis=1, mode="clip")
      return cache_LxSxGxDh.at[:, targets_M].set(moved_LxMxGxDh, mode="drop")

    move = jax.vmap(move_row, in_axes=(1, 0, 0), out_axes=1)
    return self._with_kv(move(self.k, sources_BxM, targets_BxM), move(self.v, sources_BxM, targets_BxM))


def init_cache(config: ModelConfig, batch_size: int, max_len: int,
               sharding: CacheSharding | None = None) -> KVCache:
  """An empty cache for `batch_size` rows of up to `max_len` positions (both static), laid out by
  `sharding` on the mesh set by `jax.set_mesh` (which must be set): each device allocates only its
  own shard. None: no placement asked for (one device)."""
  shape = (config.n_layers, batch_size, max_len, config.n_kv_heads, config.head_dim)

  def empty():
    zeros = lambda: jnp.zeros(shape, config.jnp_dtype)  # k and v: two buffers
    lengths = jnp.zeros((batch_size,), jnp.int32)
    if sharding is None:
      return KVCache(k=zeros(), v=zeros(), lengths=lengths)
    return KVCache(k=sharding.kv(zeros()), v=sharding.kv(zeros()), lengths=sharding.rows(lengths),
                   sharding=sharding)

  if sharding is None:
    return empty()
  if jax.sharding.get_abstract_mesh().empty:
    raise ValueError(f"init_cache: {sharding} lays the cache out on a mesh, but none is set (jax.set_mesh)")
  return jax.jit(empty)()
