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

  def write(self, layer: int, k_BxTxKxD: jax.Array, v_BxTxKxD: jax.Array) -> "KVCache":
    """Writes one layer's chunk of T keys/values at each row's own offset `lengths[b]`.

    A scatter straight into the stacked arrays, so XLA updates them in place (slicing out the
    layer and setting it back copied the whole cache per layer: 3x slower decode at S=2048).
    Positions past S_max are dropped, never clamped onto valid entries; callers check capacity.
    """
    T = k_BxTxKxD.shape[1]
    rows_Bx1 = jnp.arange(self.batch_size)[:, None]
    positions_BxT = self.lengths[:, None] + jnp.arange(T)[None, :]
    k = self.k.at[layer, rows_Bx1, positions_BxT].set(k_BxTxKxD.astype(self.k.dtype), mode="drop")
    v = self.v.at[layer, rows_Bx1, positions_BxT].set(v_BxTxKxD.astype(self.v.dtype), mode="drop")
    return self.replace(k=k, v=v)


def init_cache(config: ModelConfig, batch_size: int, max_len: int) -> KVCache:
  """An empty cache for `batch_size` rows of up to `max_len` positions (both static)."""
  shape = (config.n_layers, batch_size, max_len, config.n_kv_heads, config.head_dim)
  return KVCache(
      k=jnp.zeros(shape, config.jnp_dtype),
      v=jnp.zeros(shape, config.jnp_dtype),
      lengths=jnp.zeros((batch_size,), jnp.int32),
  )
