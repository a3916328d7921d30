"""Rotary position embeddings: the scaling variants' inverse frequencies and the rotation itself.

`RopeScaling` is the static description of one variant (transformers' `rope_type` and its parameters);
`inverse_frequencies` is the one place its frequencies are computed, mirroring transformers'
`modeling_rope_utils` operation by operation in float32:

- `default`: inv_freq_i = theta^(-2i / Dh).
- `linear`: default / factor (positions interpolated by `factor`).
- `llama3`: low frequencies (wavelength > original context / low_freq_factor) divided by `factor`, high
  ones (wavelength < original context / high_freq_factor) kept, a smooth blend in between.
- `yarn`: per dimension a ramp between the interpolated (/ factor) and the extrapolated frequencies over
  the dimensions that turn between `beta_fast` and `beta_slow` times in the original context; cos and
  sin are multiplied by `attention_factor` (so attention scores by its square).
- `dynamic` (NTK): the base grows with the sequence length L seen, theta * (factor L / L0 - factor +
  1)^(Dh / (Dh - 2)) once L exceeds the original context L0 (= `max_position_embeddings`).

Dynamic NTK in a static cache: transformers recomputes the frequencies per forward call from the
largest position of the call (`seq_len = max(position_ids) + 1`) and rotates every query and key of the
call with them; keys already in its cache keep the rotation of the call that wrote them. specjax
instead rotates the token at position p with the frequencies of L = max(p + 1, L0): a function of the
position alone, so a row's keys never depend on how its tokens were chunked (prefill chunks, verify
blocks, ragged batches) and incremental decoding equals a full forward. The two agree exactly wherever
each call of transformers ends at the token being rotated, or lies within L0: one-token decode steps,
and any call whose positions are all < L0. Hence `transformers.generate` from a prompt of at most L0
tokens gives the same logits and tokens at every step, also far past L0. They differ for a single call
that runs past L0 with more than one token (a prompt longer than L0, a full forward over more than L0
tokens): transformers rotates all of that call's tokens, even those before L0, with the frequencies of
its last position, specjax each token with its own.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """One RoPE variant and its parameters (static, hashable); fields a type does not use keep defaults."""

  type: str = "default"  # one of ROPE_TYPES
  factor: float = 1.0  # context extension factor (all but default)
  original_max_positions: int = 0  # pre-training context L0 (dynamic, yarn, llama3)
  low_freq_factor: float = 1.0  # llama3
  high_freq_factor: float = 4.0  # llama3
  beta_fast: float = 32.0  # yarn: rotations bounding the extrapolated dimensions
  beta_slow: float = 1.0  # yarn: rotations bounding the interpolated dimensions
  attention_factor: float = 1.0  # yarn: multiplies cos and sin (resolved from factor / mscale on load)
  truncate: bool = True  # yarn: round the correction range to whole dimensions

  def __post_init__(self):
    if self.type not in ROPE_TYPES:
      raise ValueError(f"unsupported RoPE type {self.type!r}; supported: {ROPE_TYPES}")
    if self.type in ("dynamic", "yarn", "llama3") and self.original_max_positions < 1:
      raise ValueError(f"RoPE type {self.type!r} needs original_max_positions >= 1")


def _exponents(dim: int) -> jax.Array:
  """2i / dim for i < dim / 2: theta to these powers are the wavelengths / 2 pi."""
  return jnp.arange(0, dim, 2, dtype=jnp.float32) / dim


def _llama3(inv_freq_Fq: jax.Array, s: RopeScaling) -> jax.Array:
  low_freq_wavelen = s.original_max_positions / s.low_freq_factor
  high_freq_wavelen = s.original_max_positions / s.high_freq_factor
  wavelen_Fq = 2 * math.pi / inv_freq_Fq
  scaled_Fq = jnp.where(wavelen_Fq > low_freq_wavelen, inv_freq_Fq / s.factor, inv_freq_Fq)
  smooth_Fq = (s.original_max_positions / wavelen_Fq - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  smoothed_Fq = (1 - smooth_Fq) * scaled_Fq / s.factor + smooth_Fq * scaled_Fq
  is_medium_Fq = ~(wavelen_Fq < high_freq_wavelen) & ~(wavelen_Fq > low_freq_wavelen)
  return jnp.where(is_medium_Fq, smoothed_Fq, scaled_Fq)


def _yarn(theta: float, dim: int, s: RopeScaling) -> jax.Array:
  def correction_dim(rotations):
    return dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp
  pos_freqs_Fq = theta**_exponents(dim)
  ramp_Fq = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  extrapolation_Fq = 1 - ramp_Fq
  return (1.0 / (s.factor * pos_freqs_Fq)) * (1 - extrapolation_Fq) + (1.0 / pos_freqs_Fq) * extrapolation_Fq


def inverse_frequencies(scaling: RopeScaling, theta: float, dim: int,
                        positions_BxT: jax.Array) -> tuple[jax.Array, float]:
  """Float32 inverse frequencies of `scaling` for a rotary width `dim`, and the factor on cos / sin.

  The frequencies broadcast against `positions_BxT[..., None]`: [1, 1, dim / 2], or [B, T, dim / 2] for
  `dynamic`, whose frequencies depend on each token's position (see the module docstring).
  """
  if scaling.type == "dynamic":
    seq_len_BxTx1 = jnp.maximum(positions_BxT + 1, scaling.original_max_positions)[..., None]
    stretch = scaling.factor * seq_len_BxTx1.astype(jnp.float32) / scaling.original_max_positions
    base_BxTx1 = theta * (stretch - (scaling.factor - 1))**(dim / (dim - 2))
    return 1.0 / (base_BxTx1**_exponents(dim).reshape(1, 1, -1)), 1.0
  if scaling.type == "yarn":
    inv_freq_Fq = _yarn(theta, dim, scaling)
  else:
    inv_freq_Fq = 1.0 / (theta**_exponents(dim))
    if scaling.type == "linear":
      inv_freq_Fq = inv_freq_Fq / scaling.factor
    elif scaling.type == "llama3":
      inv_freq_Fq = _llama3(inv_freq_Fq, scaling)
  return inv_freq_Fq.reshape(1, 1, -1), scaling.attention_factor if scaling.type == "yarn" else 1.0


def cos_sin(scaling: RopeScaling, theta: float, dim: int, positions_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos and sin [B, T, dim / 2] of the rotation angles of every token (times yarn's attention factor)."""
  inv_freq, attention_factor = inverse_frequencies(scaling, theta, dim, positions_BxT)
  angles_BxTxFq = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(angles_BxTxFq) * attention_factor, jnp.sin(angles_BxTxFq) * attention_factor


def rotate(x_BxTxHxDh: jax.Array, cos_BxTxFq: jax.Array, sin_BxTxFq: jax.Array) -> jax.Array:
  """RoPE in the Hugging Face "rotate half" convention (first half / second half pairs), in float32."""
  half = x_BxTxHxDh.shape[-1] // 2
  cos, sin = cos_BxTxFq[:, :, None, :], sin_BxTxFq[:, :, None, :]  # [B, T, 1, Fq], Fq = Dh / 2
  x1, x2 = x_BxTxHxDh[..., :half].astype(jnp.float32), x_BxTxHxDh[..., half:].astype(jnp.float32)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_BxTxHxDh.dtype)
