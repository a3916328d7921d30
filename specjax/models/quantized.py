"""Quantized weights: a weight format is a property of the params, not a flag in the model code.

A quantized weight is a `QuantizedWeight`, one node of the params tree where a float `[out, in]` array
would be (codes + scales + its static `WeightFormat`), and `matmul.dense` dispatches on it: the model
code (`transformer.Linear`, the output head) is the same for every format. Formats (`parse`):

- "float": no quantization (the weights in the model's dtype, `config.dtype`).
- "int8": one float32 scale per output channel (row of W), codes in [-127, 127] (int8).
- "int4", "int4:G": one bfloat16 scale per group of G consecutive input elements of a row (G in
  32..128, even, dividing every input width of the model; "int4" is G = 32, the block of MXFP4 and of
  llama.cpp's Q4_0), codes in [-7, 7], two per byte as in Q4_0 (uint8: within each group, element j
  in the low nibble and element j + G / 2 in the high one, each stored as code + 8), so that a group
  unpacks into its two halves without interleaving.
- "int4a8", "int4a8:G": int4:G's weights (the same codes and scales, and the same cached bytes under
  their own name), but x is quantized at run time per row and group of G inputs to int8, as llama.cpp's
  Q8_0 activations for its Q4_0 x Q8_0 dots: d = max |x| / 127, code = x / d rounded half to even (both
  divisions in float32; all codes 0 where d = 0; `quantize_activations`). Per group an exact integer dot
  product I = sum code_x code_w (int32), and y = sum over groups of (d * scale) * I in float32. The CPU
  kernel sums the groups in a fixed order (16 lanes by FMA, then a fixed tree: `cpu_kernels/matmul.cc`),
  the same bits on its portable and AVX512-VNNI paths; XLA's path (`_int4a8`) sums them in XLA's order
  (equal up to float32 rounding, the integer dots exactly). It computes on rounded activations, so it is
  not the dequantized float model (int4 is): a draft format, for the VNNI integer dot products (VPDPBUSD)
  where int4 widens codes to float32 and is compute-bound (docs/quantized-drafts.md has the measurements).

Symmetric (no zero point): w ~ code * scale with scale = max |w| / qmax of the channel or group, so
every element's error is at most scale / 2 (the scale rounded to bfloat16 moves max |w| / scale by at
most 2^-8 relative, which the clip at qmax absorbs), zero is exact, a dequantized weight is one
multiply, and the int8 path can scale the output instead of the weight. A zero point buys one level
of 16 for skewed groups; trained weights are near-symmetric per group, and ML-SpecQD's MXFP4 and
AQT's int8 are symmetric too.

What is quantized (`quantize_params`): every linear weight of the blocks and the output head (for a
152k vocabulary the head is where most of a small draft's bytes go: 136M of Qwen2.5-0.5B's 494M
weights). The token embedding stays float: a step gathers B x T of its rows, never reads it whole.
A tied model keeps its float embedding for the gather and gains a quantized copy of it as its head,
`lm_head/weight` (`transformer.output_head` prefers that copy).

How it multiplies: through the CPU kernel when the model's matmul backend is "cpu_kernel"
(`matmul.dense`; "auto" picks it on a CPU with AVX2+FMA), which reads the codes (1 or 1/2 byte a
weight), widens them to float32 in registers and multiplies x in float32 (bfloat16 x widened): int8
scales each output's sum by its channel's scale, int4 multiplies the dequantized weight code * scale,
exact in float32, so the result is the float32 product with the exactly dequantized weights (a bfloat16
model's XLA path rounds them to bfloat16 first), batch-invariant like the kernel's float paths
(`cpu_kernels/matmul.cc` documents the arithmetic). Elsewhere on XLA (`QuantizedWeight.dense`): int8
contracts x with the codes converted to x's dtype (exact: |code| <= 127 fits bfloat16's mantissa) with
float32 accumulation and multiplies the output by the channel scales; int4 dequantizes the codes to x's
dtype (code * scale is exact in float32 with bfloat16 scales; a bfloat16 model rounds it once) and
contracts, one dot per half of its groups (`_whole`). On GPU/TPU XLA fuses the conversion into the dot's
operand (the lowering report counts these conversions, `lowering.report`). On the CPU
(`lax.platform_dependent`) the weight is dequantized and multiplied CPU_ROWS output rows at a time in a
loop: XLA:CPU materialises a dequantized matrix in a fresh buffer, and a whole large one costs many times
a float matvec (its buffer leaves the caches), where tiles of CPU_ROWS rows stay in them. It still reads
the codes and writes and reads a float copy per tile, slower than the float weights it replaces, which is
why the CPU kernel unpacks in registers instead (docs/quantized-drafts.md has the measurements).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

GROUPS = (32, 128)  # the smallest and largest int4 group width
CPU_ROWS = 128  # output rows dequantized and multiplied per step on the CPU (see the module docstring)
DEFAULT_INT4_GROUP = 32
FORMATS = ("float", "int8", "int4", "int4:G", "int4a8", "int4a8:G")  # what `parse` takes (G: the group width)
ACTIVATION_BITS = 8  # int4a8: x quantized to int8 per group at run time


class FormatError(ValueError):
  """A weight format that cannot apply: unknown, or a group width that does not divide a weight's
  input width. The message does not name the config field; the caller does."""


@dataclasses.dataclass(frozen=True)
class WeightFormat:
  """How a quantized weight is stored (static, hashable)."""

  bits: int  # 8 or 4: bits per code
  group: int  # input elements sharing one scale; 0 = the whole row (one scale per output channel)
  scale_dtype: str  # "float32" or "bfloat16"
  activations: int = 0  # 0: x multiplies as floats; 8 (int4a8): x quantized to int8 per group of `group`

  @property
  def name(self) -> str:
    return "int8" if self.bits == 8 else f"int4{'a8' if self.activations else ''}:{self.group}"

  @property
  def stored(self) -> WeightFormat:
    """The format whose bytes these weights are: int4a8:G's are int4:G's (only the matmul differs)."""
    return dataclasses.replace(self, activations=0)

  @property
  def qmax(self) -> int:
    """The largest code magnitude (symmetric: codes lie in [-qmax, qmax])."""
    return 127 if self.bits == 8 else 7

  def bits_per_weight(self, in_features: int) -> float:
    """Bytes read per weight, in bits, codes and scales together."""
    group = self.group or in_features
    return self.bits + 8 * jnp.dtype(self.scale_dtype).itemsize / group

  def width_error(self, in_features: int) -> str | None:
    """Why a weight of `in_features` inputs cannot take this format (None when it can)."""
    if self.group and in_features % self.group:
      return f"groups of {self.group} do not divide an input width of {in_features}"
    return None


INT8 = WeightFormat(8, 0, "float32")


def parse(text: str) -> WeightFormat | None:
  """"float" -> None, "int8", "int4", "int4:G", "int4a8", "int4a8:G" -> their format; anything else a
  FormatError."""
  text = text.strip()
  if text == "float":
    return None
  if text == "int8":
    return INT8
  name, colon, group = text.partition(":")
  if name in ("int4", "int4a8"):
    activations = ACTIVATION_BITS if name == "int4a8" else 0
    if not colon:
      return WeightFormat(4, DEFAULT_INT4_GROUP, "bfloat16", activations)
    if group.isdigit() and GROUPS[0] <= int(group) <= GROUPS[1] and int(group) % 2 == 0:
      return WeightFormat(4, int(group), "bfloat16", activations)
    raise FormatError(f"{text!r}: an {name} group width G must be an even integer in {GROUPS[0]}..{GROUPS[1]}")
  raise FormatError(f"{text!r} is not a weight format; expected one of {', '.join(FORMATS)}")


@flax.struct.dataclass
class QuantizedWeight:
  """W [..., N, K] (leading axes: stacked layers) as codes and scales; a drop-in for the float array
  where the model reads `shape`, `dtype` and `ndim`."""

  codes: jax.Array  # int8 [..., N, K] (int8), or uint8 [..., N, K / 2] (int4: two codes a byte)
  scales: jax.Array  # [..., N, K / G] in the format's scale dtype (int8: [..., N, 1] float32)
  format: WeightFormat = flax.struct.field(pytree_node=False)
  dtype: Any = flax.struct.field(pytree_node=False)  # the model's dtype: what it dequantizes to

  @property
  def shape(self) -> tuple[int, ...]:
    *lead, n, packed = self.codes.shape
    return (*lead, n, packed * (2 if self.format.bits == 4 else 1))

  @property
  def ndim(self) -> int:
    return self.codes.ndim

  def int_codes(self) -> jax.Array:
    """The codes as int8 [..., N, K] in [-qmax, qmax] (int4 unpacked: each group's low nibbles, then
    its high ones)."""
    if self.format.bits == 8:
      return self.codes
    *lead, n, k = self.shape
    packed = self.codes.reshape(*lead, n, k // self.format.group, self.format.group // 2)
    low = (packed & 15).astype(jnp.int8) - 8
    high = (packed >> 4).astype(jnp.int8) - 8
    return jnp.concatenate([low, high], axis=-1).reshape(self.shape)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """W [..., N, K] = code * scale, computed in float32 (exact for bfloat16 scales: at most 8 x 8
    significant bits; rounded once for int8's float32 ones) and returned in `dtype`."""
    *lead, n, k = self.shape
    codes = self.int_codes().astype(jnp.float32).reshape(*lead, n, self.scales.shape[-1], -1)
    return (codes * self.scales.astype(jnp.float32)[..., None]).reshape(*lead, n, k).astype(dtype)

  def rows(self, indices: jax.Array) -> QuantizedWeight:
    """The rows `indices` of a 2-D weight (a restricted output head), still quantized."""
    return self.replace(codes=jnp.take(self.codes, indices, axis=0), scales=jnp.take(self.scales, indices, axis=0))

  def dense(self, x_xK: jax.Array, out_dtype=None) -> jax.Array:
    """x W^T [..., N] on XLA (the "xla" backend's path: `matmul.dense` dispatches) for a 2-D W,
    accumulated in float32 and returned in `out_dtype` (None: x's dtype promoted with the model's, as
    `dot_general` returns for a float weight); on the CPU CPU_ROWS rows of W at a time (the module
    docstring says why)."""
    out_dtype = out_dtype or jnp.promote_types(x_xK.dtype, self.dtype)
    return jax.lax.platform_dependent(x_xK, cpu=lambda x: self._by_rows(x, out_dtype),
                                      default=lambda x: self._whole(x, out_dtype))

  def _by_rows(self, x_xK: jax.Array, out_dtype) -> jax.Array:
    """`_whole` over tiles of CPU_ROWS rows in a loop (`lax.map`), the remaining rows in one more."""
    n = self.shape[0]
    tiles = n // CPU_ROWS
    parts = []
    if tiles:
      split = lambda a: a[:tiles * CPU_ROWS].reshape(tiles, CPU_ROWS, *a.shape[1:])
      y_TxxR = jax.lax.map(lambda tile: self.replace(codes=tile[0], scales=tile[1])._whole(x_xK, out_dtype),
                           (split(self.codes), split(self.scales)))
      parts.append(jnp.moveaxis(y_TxxR, 0, -2).reshape(*x_xK.shape[:-1], tiles * CPU_ROWS))
    if n % CPU_ROWS:
      rest = self.replace(codes=self.codes[tiles * CPU_ROWS:], scales=self.scales[tiles * CPU_ROWS:])
      parts.append(rest._whole(x_xK, out_dtype))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)

  def _whole(self, x_xK: jax.Array, out_dtype) -> jax.Array:
    """x W^T with float32 accumulation: int8 contracted with its codes and scaled after; int4 as two
    dots, one per half of every group (the low nibbles hold the first halves, the high ones the second:
    dequantized with no interleaving, which XLA:CPU ran ~15x slower); int4a8 by `_int4a8`."""
    if self.format.activations:
      return self._int4a8(x_xK, out_dtype)
    dims = (((x_xK.ndim - 1,), (1,)), ((), ()))
    if self.format.group == 0:  # one scale per output channel: scale the output, contract with the codes
      y_xN = jax.lax.dot_general(x_xK, self.codes.astype(x_xK.dtype), dims, preferred_element_type=jnp.float32)
      scale_xN = self.scales[:, 0].astype(jnp.float32).reshape((1,) * (y_xN.ndim - 1) + (-1,))
      return (y_xN * scale_xN).astype(out_dtype)
    (n, k), group = self.shape, self.format.group
    packed_NxGxH = self.codes.reshape(n, k // group, group // 2)
    scale_NxGx1 = self.scales.astype(jnp.float32)[..., None]
    x_xGxE = x_xK.reshape(*x_xK.shape[:-1], k // group, group)
    y_xN = 0.0
    for half, nibbles_NxGxH in enumerate((packed_NxGxH & 15, packed_NxGxH >> 4)):
      w_NxH = ((nibbles_NxGxH.astype(jnp.float32) - 8.0) * scale_NxGx1).reshape(n, k // 2).astype(x_xK.dtype)
      x_xH = x_xGxE[..., half * group // 2:(half + 1) * group // 2].reshape(*x_xK.shape[:-1], k // 2)
      y_xN = y_xN + jax.lax.dot_general(x_xH, w_NxH, dims, preferred_element_type=jnp.float32)
    return y_xN.astype(out_dtype)

  def _int4a8(self, x_xK: jax.Array, out_dtype) -> jax.Array:
    """int4a8: x quantized per group (`quantize_activations`), per group the exact int32 dot product of
    its codes with the weight's, then the sum over groups of (d * scale) * dot in float32 (XLA's order
    of that sum, not the kernel's: equal up to float32 rounding, the integer dots exactly)."""
    (n, k), group = self.shape, self.format.group
    q_xGxE, d_xG = quantize_activations(x_xK, group)
    codes_NxGxE = self.int_codes().reshape(n, k // group, group)
    dot_xGxN = jnp.einsum("...ge,nge->...gn", q_xGxE, codes_NxGxE, preferred_element_type=jnp.int32)
    scale_GxN = self.scales.astype(jnp.float32).T
    t_xGxN = d_xG[..., None] * scale_GxN.reshape((1,) * (d_xG.ndim - 1) + scale_GxN.shape)
    return jnp.sum(t_xGxN * dot_xGxN.astype(jnp.float32), axis=-2).astype(out_dtype)


def quantize_activations(x_xK: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
  """int4a8's x [..., K] as int8 codes [..., K / G, G] and float32 scales d [..., K / G] (G = `group`):
  per group d = max |x| / 127 and code = x / d rounded half to even (both divisions in float32; all
  codes 0 where d = 0), in [-127, 127]: llama.cpp's Q8_0 blocks, the kernel's quantization bit for bit."""
  x_xGxE = x_xK.astype(jnp.float32).reshape(*x_xK.shape[:-1], x_xK.shape[-1] // group, group)
  # Divisions, as the kernel's: XLA turns a division by a constant or a broadcast into a multiply by a
  # rounded reciprocal, unless the divisor is a full array it cannot see into (optimization_barrier).
  amax_xG = jnp.max(jnp.abs(x_xGxE), axis=-1)
  d_xG = amax_xG / jax.lax.optimization_barrier(jnp.full_like(amax_xG, 127))
  divisor_xGxE = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.where(d_xG == 0, 1, d_xG)[..., None], x_xGxE.shape))
  codes = jnp.where(d_xG[..., None] == 0, 0.0, jnp.round(x_xGxE / divisor_xGxE))
  return jnp.clip(codes, -127, 127).astype(jnp.int8), d_xG


def take_rows(weight, indices: jax.Array):
  """Rows `indices` of a [N, K] weight, float or quantized."""
  if isinstance(weight, QuantizedWeight):
    return weight.rows(indices)
  return jnp.take(weight, indices, axis=0)


def format_error(config, fmt: WeightFormat) -> str | None:
  """Why the model of `config` (a `ModelConfig`) cannot take `fmt` (None when it can): an int4 group
  width must divide every quantized weight's input width (d_model, heads x head_dim, d_ff)."""
  widths = {"d_model": config.d_model, "n_heads * head_dim": config.n_heads * config.head_dim, "d_ff": config.d_ff}
  for name, width in widths.items():
    error = fmt.width_error(width)
    if error:
      return f"{fmt.name}: {error} ({name})"
  return None


@functools.partial(jax.jit, static_argnums=(1, 2))
def quantize(weight: jax.Array, fmt: WeightFormat, dtype: Any = jnp.float32) -> QuantizedWeight:
  """W [..., N, K] (float; leading axes allowed) in format `fmt`, dequantizing to `dtype`: per channel
  or group, scale = max |w| / qmax rounded to the scale dtype (1 for an all-zero group), code =
  round(w / scale) clipped to [-qmax, qmax]. Every element's error is at most scale / 2."""
  *lead, n, k = weight.shape
  error = fmt.width_error(k)
  if error:
    raise FormatError(f"{fmt.name}: {error}")
  group = fmt.group or k
  w_xNxGxE = weight.astype(jnp.float32).reshape(*lead, n, k // group, group)
  scale_xNxG = (jnp.max(jnp.abs(w_xNxGxE), axis=-1) / fmt.qmax).astype(fmt.scale_dtype)
  scale_xNxG = jnp.where(scale_xNxG == 0, jnp.ones_like(scale_xNxG), scale_xNxG)
  codes = jnp.clip(jnp.round(w_xNxGxE / scale_xNxG.astype(jnp.float32)[..., None]), -fmt.qmax, fmt.qmax)
  codes = codes.astype(jnp.int8).reshape(*lead, n, k)
  if fmt.bits == 4:  # within each group: element j in the low nibble, j + G / 2 in the high one
    biased = (codes + 8).astype(jnp.uint8).reshape(*lead, n, k // group, group)
    codes = (biased[..., :group // 2] | (biased[..., group // 2:] << 4)).reshape(*lead, n, k // 2)
  return QuantizedWeight(codes, scale_xNxG, fmt, jnp.dtype(dtype))


def float_weight(weight) -> jax.Array:
  """A weight as a float array: quantized ones dequantized (to their model dtype)."""
  return weight.dequantize(weight.dtype) if isinstance(weight, QuantizedWeight) else weight


def _is_quantized(node) -> bool:
  return isinstance(node, QuantizedWeight)


def quantize_params(config, params: Any, fmt: WeightFormat | None) -> Any:
  """`params` of the model `config` (either layout) with every linear weight of the blocks and the
  output head in `fmt` (the module docstring says which; a tied model gains its quantized head as
  `lm_head/weight`); already quantized weights are requantized from their dequantized values. None:
  `params` unchanged. A FormatError before anything is quantized when a width does not fit."""
  if fmt is None:
    return params
  error = format_error(config, fmt)
  if error:
    raise FormatError(error)

  def convert(path, leaf):
    if path[-1].key == "weight" and leaf.ndim >= 2:
      return quantize(float_weight(leaf), fmt, config.jnp_dtype)
    return leaf

  params = jax.tree_util.tree_map_with_path(convert, params, is_leaf=_is_quantized)
  if config.tie_embeddings:
    params = {**params, "lm_head": {"weight": quantize(params["embed"]["embedding"], fmt, config.jnp_dtype)}}
  return params


def dequantized_params(params: Any) -> Any:
  """`params` with every quantized weight replaced by its dequantized float values (the model these
  weights compute exactly, up to the order of float rounding)."""
  return jax.tree.map(float_weight, params, is_leaf=_is_quantized)


def describe(params: Any) -> str:
  """The formats of a params tree's quantized weights, for run stats ("float" when it has none)."""
  formats = {leaf.format.name for leaf in jax.tree.leaves(params, is_leaf=_is_quantized) if _is_quantized(leaf)}
  return ", ".join(sorted(formats)) or "float"
