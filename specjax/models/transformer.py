"""The decoder-only transformer (Llama / Qwen2 / Mistral and GPT-2) as Flax linen modules.

Pure forward: `forward(config, params, tokens_BxT, cache) -> (logits_BxTxV, cache)`. Token t of row b
sits at position `cache.lengths[b] + t`; its keys/values are written there and it attends to every
position <= its own. `cache.lengths` is not advanced: the caller commits with `KVCache.advance`.

Parameter tree (the loaders in this package produce it). Linear weights keep the Hugging Face
`[out, in]` layout, named `weight`, and are contracted on `in`: on XLA CPU this was measurably faster
for multi-token forwards (up to 1.5x at T = 5-9 in a 1536 x 8960 matmul, 2 cores) and makes loading a
plain copy.
  embed/embedding [V, D]; pos_embed/embedding [P, D] (gpt2)
  layers_{i}/attn_norm/{scale, bias?}, layers_{i}/mlp_norm/{scale, bias?}
  layers_{i}/attn/{q_proj, k_proj, v_proj, o_proj}/{weight [out, in], bias? [out]}
  layers_{i}/mlp/{gate_proj (llama only), up_proj, down_proj}/{weight, bias? (gpt2)}
  final_norm/{scale, bias?}; lm_head/weight [V, D] (absent when tie_embeddings)
Layers are separate subtrees run by a Python loop: on XLA CPU a first probe of `lax.scan` over stacked
weights ran 3.6-4.5x slower (a later one at width 512 only ~1.25x slower, with compile time flat in
depth where the unrolled loop grows ~0.4 s per layer; measure before switching).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, init_cache

Params = Any
_init = nn.initializers.normal(stddev=0.02)


def _along_last(vector_N: jax.Array, ndim: int) -> jax.Array:
  """Reshapes a [N] vector to broadcast against the last axis of an `ndim`-rank array."""
  return vector_N.reshape((1,) * (ndim - 1) + (-1,))


class Linear(nn.Module):
  """y = x W^T (+ b) with W stored `[out, in]`."""

  features: int
  use_bias: bool
  dtype: Any

  @nn.compact
  def __call__(self, x_BxTxI):
    weight_OxI = self.param("weight", _init, (self.features, x_BxTxI.shape[-1]), self.dtype)
    y_BxTxO = jax.lax.dot_general(x_BxTxI, weight_OxI, (((x_BxTxI.ndim - 1,), (1,)), ((), ())))
    if self.use_bias:
      bias_O = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
      y_BxTxO = y_BxTxO + _along_last(bias_O, y_BxTxO.ndim)
    return y_BxTxO


class Norm(nn.Module):
  """RMSNorm (llama) or LayerNorm (gpt2), computed in float32 like the reference implementations."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.config
    x = x_BxTxD.astype(jnp.float32)
    scale = _along_last(self.param("scale", nn.initializers.ones, (cfg.d_model,), cfg.jnp_dtype), x.ndim)
    if cfg.arch == "gpt2":
      bias = _along_last(self.param("bias", nn.initializers.zeros, (cfg.d_model,), cfg.jnp_dtype), x.ndim)
      x = x - x.mean(-1, keepdims=True)
      x = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps)
      return (x * scale + bias).astype(cfg.jnp_dtype)
    x = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps)
    return scale * x.astype(cfg.jnp_dtype)


def rotate_by_position(x_BxTxHxD: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
  """RoPE in the Hugging Face "rotate half" convention (first half / second half pairs)."""
  half = x_BxTxHxD.shape[-1] // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / x_BxTxHxD.shape[-1]))
  angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
  cos = jnp.cos(angles_BxTxF)[:, :, None, :]  # [B, T, 1, D/2]
  sin = jnp.sin(angles_BxTxF)[:, :, None, :]
  x1, x2 = x_BxTxHxD[..., :half].astype(jnp.float32), x_BxTxHxD[..., half:].astype(jnp.float32)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_BxTxHxD.dtype)


def attention_mask(lengths_B: jax.Array, num_queries: int, max_len: int, window: int) -> jax.Array:
  """[B, T, S] True where query t of row b (at position lengths[b] + t) may attend to key s."""
  query_pos_BxT = lengths_B[:, None] + jnp.arange(num_queries)[None, :]
  key_pos_S = jnp.arange(max_len)
  mask_BxTxS = key_pos_S[None, None, :] <= query_pos_BxT[:, :, None]
  if window:
    mask_BxTxS &= key_pos_S[None, None, :] > query_pos_BxT[:, :, None] - window
  return mask_BxTxS


class Attention(nn.Module):
  """Grouped-query attention over the static cache of one layer."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, cache: KVCache, layer: int):
    cfg = self.config
    B, T, _ = x_BxTxD.shape
    H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    bias = cfg.qkv_bias or cfg.arch == "gpt2"
    q = Linear(H * Dh, bias, cfg.jnp_dtype, name="q_proj")(x_BxTxD).reshape(B, T, H, Dh)
    k = Linear(K * Dh, bias, cfg.jnp_dtype, name="k_proj")(x_BxTxD).reshape(B, T, K, Dh)
    v = Linear(K * Dh, bias, cfg.jnp_dtype, name="v_proj")(x_BxTxD).reshape(B, T, K, Dh)
    if cfg.arch == "llama":
      q = rotate_by_position(q, positions_BxT, cfg.rope_theta)
      k = rotate_by_position(k, positions_BxT, cfg.rope_theta)
    cache = cache.write(layer, k, v)
    k_cache_BxSxKxD, v_cache_BxSxKxD = cache.k[layer], cache.v[layer]

    q_BxTxKxGxD = q.reshape(B, T, K, H // K, Dh)
    scores_BxKxGxTxS = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_cache_BxSxKxD,
                                  preferred_element_type=jnp.float32) * (Dh ** -0.5)
    scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS, -jnp.inf)
    weights = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(cfg.jnp_dtype)
    out_BxTxKxGxD = jnp.einsum("bkgts,bskd->btkgd", weights, v_cache_BxSxKxD)
    out = Linear(cfg.d_model, cfg.arch == "gpt2", cfg.jnp_dtype, name="o_proj")(
        out_BxTxKxGxD.reshape(B, T, H * Dh))
    return out, cache


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.config
    if cfg.arch == "gpt2":
      hidden = Linear(cfg.d_ff, True, cfg.jnp_dtype, name="up_proj")(x_BxTxD)
      hidden = jax.nn.gelu(hidden, approximate=True)  # GPT-2's "gelu_new"
      return Linear(cfg.d_model, True, cfg.jnp_dtype, name="down_proj")(hidden)
    gate = Linear(cfg.d_ff, False, cfg.jnp_dtype, name="gate_proj")(x_BxTxD)
    up = Linear(cfg.d_ff, False, cfg.jnp_dtype, name="up_proj")(x_BxTxD)
    return Linear(cfg.d_model, False, cfg.jnp_dtype, name="down_proj")(jax.nn.silu(gate) * up)


class Block(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, cache: KVCache, layer: int):
    attn_out, cache = Attention(self.config, name="attn")(
        Norm(self.config, name="attn_norm")(x_BxTxD), positions_BxT, mask_BxTxS, cache, layer)
    x_BxTxD = x_BxTxD + attn_out
    x_BxTxD = x_BxTxD + MLP(self.config, name="mlp")(Norm(self.config, name="mlp_norm")(x_BxTxD))
    return x_BxTxD, cache


class Transformer(nn.Module):
  """`layers` (static) runs only those blocks, in order (self-speculation drafts with a subset of the
  target's layers, reading and writing the target's own cache at those layers); None runs them all."""

  config: ModelConfig
  layers: tuple[int, ...] | None = None

  def setup(self):
    cfg = self.config
    self.embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init, dtype=cfg.jnp_dtype,
                          param_dtype=cfg.jnp_dtype)
    if cfg.arch == "gpt2":
      self.pos_embed = nn.Embed(cfg.max_positions, cfg.d_model, embedding_init=_init,
                                dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_dtype)
    self.blocks = [Block(cfg, name=f"layers_{i}") for i in range(cfg.n_layers)]
    self.final_norm = Norm(cfg)
    if not cfg.tie_embeddings:
      self.lm_head = Linear(cfg.vocab_size, False, cfg.jnp_dtype)

  def __call__(self, tokens_BxT: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Final-norm hidden states [B, T, D] and the cache with this chunk's keys/values written."""
    cfg = self.config
    T = tokens_BxT.shape[1]
    positions_BxT = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    x_BxTxD = self.embed(tokens_BxT)
    if cfg.arch == "gpt2":
      x_BxTxD = x_BxTxD + self.pos_embed(positions_BxT)
    mask_BxTxS = attention_mask(cache.lengths, T, cache.max_len, cfg.sliding_window)
    for i in range(cfg.n_layers) if self.layers is None else self.layers:
      x_BxTxD, cache = self.blocks[i](x_BxTxD, positions_BxT, mask_BxTxS, cache, i)
    return self.final_norm(x_BxTxD), cache

  def logits(self, hidden_BxNxD: jax.Array) -> jax.Array:
    """Output-head logits in float32 for any [..., D] hidden states."""
    if self.config.tie_embeddings:
      logits = self.embed.attend(hidden_BxNxD)
    else:
      logits = self.lm_head(hidden_BxNxD)
    return logits.astype(jnp.float32)

  def logits_and_cache(self, tokens_BxT: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    hidden_BxTxD, cache = self(tokens_BxT, cache)
    return self.logits(hidden_BxTxD), cache


def forward_hidden(config: ModelConfig, params: Params, tokens_BxT: jax.Array, cache: KVCache,
                   layers: tuple[int, ...] | None = None) -> tuple[jax.Array, KVCache]:
  """Hidden states [B, T, D] (after the final norm) and the written (not advanced) cache; through the
  blocks `layers` only (static) when given."""
  return Transformer(config, layers).apply({"params": params}, tokens_BxT, cache)


def hidden_to_logits(config: ModelConfig, params: Params, hidden_xD: jax.Array) -> jax.Array:
  """Float32 logits [..., V] for hidden states [..., D]."""
  return Transformer(config).apply({"params": params}, hidden_xD, method=Transformer.logits)


def forward(config: ModelConfig, params: Params, tokens_BxT: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Logits [B, T, V] (float32) of every position and the written (not advanced) cache."""
  return Transformer(config).apply({"params": params}, tokens_BxT, cache,
                                   method=Transformer.logits_and_cache)


def init_params(config: ModelConfig, key: jax.Array) -> Params:
  """Random parameters (normal, std 0.02) in the tree the loaders produce; for tests and fresh drafts."""
  cache = init_cache(config, batch_size=1, max_len=1)
  tokens_1x1 = jnp.zeros((1, 1), jnp.int32)
  return Transformer(config).init(key, tokens_1x1, cache, method=Transformer.logits_and_cache)["params"]


def prefill(config: ModelConfig, params: Params, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Feeds right-padded prompts of different lengths in one call.

  Returns the float32 logits [B, V] at each row's last prompt token and the cache advanced by each
  row's own prompt length (the padding's keys lie beyond the length: masked, later overwritten).
  """
  hidden_BxPxD, cache = forward_hidden(config, params, prompts_BxP, cache)
  last_BxD = jnp.take_along_axis(hidden_BxPxD, (prompt_lengths_B - 1)[:, None, None], axis=1)[:, 0]
  return hidden_to_logits(config, params, last_BxD), cache.advance(prompt_lengths_B)
