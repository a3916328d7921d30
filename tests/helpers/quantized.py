"""Quantized weights read back independently of `specjax.models.quantized`: the codes unpacked and
dequantized in float64 numpy from the stored bytes and the format's documented layout, and random
weights that exercise the corner cases (an all-zero group, outliers, stacked layers)."""

import jax.numpy as jnp
import numpy as np

from specjax.models import quantized


def unpacked_codes(weight) -> np.ndarray:
  """int64 codes [..., N, K] of a `QuantizedWeight`, from its stored bytes: int8 as stored; int4 two per
  uint8 byte as in llama.cpp's Q4_0: within each group of G, byte j holds element j in its low nibble
  and element j + G / 2 in its high one, each stored as code + 8."""
  stored = np.asarray(weight.codes)
  if weight.format.bits == 8:
    assert stored.dtype == np.int8
    return stored.astype(np.int64)
  assert stored.dtype == np.uint8
  codes = np.empty(stored.shape[:-1] + (2 * stored.shape[-1],), np.int64)
  half = weight.format.group // 2
  for byte in range(stored.shape[-1]):
    group, j = divmod(byte, half)
    codes[..., group * 2 * half + j] = (stored[..., byte] & 15).astype(np.int64) - 8
    codes[..., group * 2 * half + half + j] = (stored[..., byte] >> 4).astype(np.int64) - 8
  return codes


def float64_scales(weight) -> np.ndarray:
  """[..., N, K / G] float64 scales of a `QuantizedWeight` (int8: [..., N, 1])."""
  return np.asarray(weight.scales.astype("float32"), np.float64)


def dequantized64(weight) -> np.ndarray:
  """W [..., N, K] = code * scale in float64."""
  codes, scales = unpacked_codes(weight), float64_scales(weight)
  group = codes.shape[-1] // scales.shape[-1]
  return (codes * np.repeat(scales, group, axis=-1))


def random_weights(shape, seed: int) -> np.ndarray:
  """float32 weights with heavy-tailed rows (a few outliers), one all-zero group of 32 and one row of
  tiny values, so that scales span orders of magnitude."""
  rng = np.random.default_rng(seed)
  w = rng.standard_t(3, size=shape).astype(np.float32) * 0.05
  w[..., 0, :32] = 0.0
  w[..., 1, :] *= 1e-4
  return w


def int4a8_reference(x, q):
  """int4a8's definition in numpy for x [M, K] and a QuantizedWeight `q`: x quantized per row and group of G
  (d = max |x| / 127 and x / d in float32, rounded half to even; 0 where d = 0), the exact integer dots I
  [M, groups, N] (int64), t = d * scale rounded to float32; returns (the float64 sum of t I over groups,
  the sum of |t I|, x's codes [M, groups, G])."""
  group = q.format.group
  x32 = np.asarray(x, np.float32).reshape(x.shape[0], -1, group)
  d = np.max(np.abs(x32), axis=-1) / np.float32(127)
  with np.errstate(divide="ignore", invalid="ignore"):
    codes = np.where(d[..., None] == 0, 0, np.round(x32 / d[..., None])).astype(np.int64)
  dots = np.einsum("mge,nge->mgn", codes, unpacked_codes(q).reshape(q.shape[0], -1, group))
  t = (d[..., None] * np.asarray(q.scales, np.float32).T[None]).astype(np.float64)  # float32 products
  return (t * dots).sum(1), np.abs(t * dots).sum(1), codes


def int4a8_exact_operands(name, M, N, groups, seed):
  """int4a8 operands on which every float operation is exact: integer weights in [-7, 7] with a 7 in every
  group (scale 1), x half-integers in bfloat16 with 127 in every group (d = 1; ties everywhere), so y is
  the integer sum of the integer dots. Returns x, W and that sum (int64 [M, N])."""
  fmt = quantized.parse(name)
  rng = np.random.default_rng(seed)
  w = rng.integers(-7, 8, (N, groups * fmt.group))
  w[:, ::fmt.group] = 7
  x = rng.integers(-254, 255, (M, groups * fmt.group)) / 2
  x[:, 1::fmt.group] = 127 * rng.choice([-1, 1], (M, groups))
  q = quantized.quantize(jnp.asarray(w, jnp.float32), fmt, jnp.bfloat16)
  assert np.all(np.asarray(q.scales, np.float32) == 1)
  return jnp.asarray(x, jnp.bfloat16), q, np.round(x).astype(np.int64) @ w.T
