"""The static KV cache: preallocated key/value arrays plus per-row lengths, an explicit pytree.

A forward pass writes its chunk of T keys/values at each row's own offset `lengths[b]` but does not
advance `lengths`; the caller commits what it keeps with `advance`. Rolling back a rejected suffix is
therefore free: the row's length does not move and the attention mask hides whatever lies beyond it,
to be overwritten by the next write.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S_max, H_kv, D_h] keys of every layer
  v: jax.Array  # [L, B, S_max, H_kv, D_h] values of every layer
  lengths: jax.Array  # [B] int32: committed tokens per row (= position of the row's next token)

  @property
  def max_len(self) -> int:
    """S_max, static: the number of positions each row can hold."""
    return self.k.shape[2]

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  def advance(self, num_tokens_B: jax.Array) -> "KVCache":
    """Commits `num_tokens_B[b]` more of the tokens last written to row b."""
    return self.replace(lengths=self.lengths + num_tokens_B.astype(jnp.int32))


def init_cache(config: ModelConfig, batch_size: int, max_len: int) -> KVCache:
  """An empty cache for `batch_size` rows of up to `max_len` positions (both static)."""
  shape = (config.n_layers, batch_size, max_len, config.n_kv_heads, config.head_dim)
  return KVCache(
      k=jnp.zeros(shape, config.jnp_dtype),
      v=jnp.zeros(shape, config.jnp_dtype),
      lengths=jnp.zeros((batch_size,), jnp.int32),
  )


def write_rows(cache_BxSxHxD: jax.Array, chunk_BxTxHxD: jax.Array, offsets_B: jax.Array) -> jax.Array:
  """Writes row b's chunk at position `offsets_B[b]` of that row (one layer's keys or values).

  Offsets must leave room for the chunk (offset + T <= S_max); the callers check this on the host,
  because `dynamic_update_slice` would silently clamp an out-of-range offset.
  """
  write_one = lambda row_SxHxD, chunk_TxHxD, offset: jax.lax.dynamic_update_slice(
      row_SxHxD, chunk_TxHxD.astype(row_SxHxD.dtype), (offset, 0, 0))
  return jax.vmap(write_one)(cache_BxSxHxD, chunk_BxTxHxD, offsets_B)
