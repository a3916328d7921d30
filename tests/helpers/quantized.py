"""Quantized weights read back independently of `specjax.models.quantized`: the codes unpacked and
dequantized in float64 numpy from the stored bytes and the format's documented layout, and random
weights that exercise the corner cases (an all-zero group, outliers, stacked layers)."""

import numpy as np


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
