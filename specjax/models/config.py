"""`ModelConfig`: the frozen, hashable description of one decoder-only transformer.

One family covers Llama / Qwen2 / Mistral (RoPE, RMSNorm, gated SiLU MLP, grouped-query attention,
optional q/k/v bias, tied or untied head) and GPT-2 (learned positions, LayerNorm, GELU MLP, biases
everywhere, tied head). The config is a static argument of every jitted function: changing it
recompiles.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

ARCHITECTURES = ("llama", "gpt2")
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of one model; every field is static (hashable) under `jax.jit`."""

  arch: str  # "llama" (also Qwen2 / Mistral) or "gpt2"
  vocab_size: int  # V: rows of the embedding and of the output head
  d_model: int  # D: width of the residual stream
  n_layers: int  # number of transformer blocks
  n_heads: int  # H: query heads
  n_kv_heads: int  # H_kv: key/value heads (H % H_kv == 0; H_kv < H is grouped-query attention)
  head_dim: int  # D_h: width of one head
  d_ff: int  # F: hidden width of the MLP
  norm_eps: float = 1e-6  # epsilon of RMSNorm / LayerNorm
  rope_theta: float = 10000.0  # RoPE base (llama only)
  max_positions: int = 0  # rows of the learned position table (gpt2 only)
  qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2: True)
  tie_embeddings: bool = False  # output head = token embedding (GPT-2, small Qwen2 models)
  sliding_window: int = 0  # Mistral-style local attention window; 0 = full causal attention
  dtype: str = "float32"  # compute and parameter dtype ("bfloat16" on GPU/TPU)
  # How to run it (static, no effect on the numbers beyond float rounding):
  scan_layers: bool = False  # params stacked under `layers` with a leading [L] axis, run by `lax.scan`
  attention_block: int = 256  # keys per block of the live-length attention; 0 = dense over S_max
  prefill_chunk: int = 512  # prompt tokens fed per prefill pass (peak memory ~ chunk x live keys)
  remat: bool = False  # `jax.checkpoint` around each block: a backward pass recomputes the block's activations

  def __post_init__(self):
    if self.arch not in ARCHITECTURES:
      raise ValueError(f"unsupported architecture {self.arch!r}; expected one of {ARCHITECTURES}")
    if self.dtype not in _DTYPES:
      raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {_DTYPES}")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
      if getattr(self, name) < 1:
        raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.attention_block < 0 or self.prefill_chunk < 1:
      raise ValueError(f"attention_block must be >= 0 and prefill_chunk >= 1, got {self.attention_block} "
                       f"and {self.prefill_chunk}")
    if self.arch == "gpt2" and self.max_positions < 1:
      raise ValueError("gpt2 needs max_positions >= 1 (rows of its learned position table)")

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    """Parameter count implied by the config (for reports and memory estimates)."""
    attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
    if self.arch == "gpt2":
      attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads) + self.d_model
      mlp = 2 * self.d_model * self.d_ff + self.d_ff + self.d_model
      norms = 4 * self.d_model
    else:
      attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads) * self.qkv_bias
      mlp = 3 * self.d_model * self.d_ff
      norms = 2 * self.d_model
    total = self.n_layers * (attn + mlp + norms) + self.vocab_size * self.d_model
    total += self.d_model * (2 if self.arch == "gpt2" else 1)
    total += self.max_positions * self.d_model if self.arch == "gpt2" else 0
    total += 0 if self.tie_embeddings else self.vocab_size * self.d_model
    return total
