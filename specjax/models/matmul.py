"""Every weight matmul of the models, `y = x W^T` with W stored `[out, in]`, on one of two backends.

- "xla": `lax.dot_general`, what XLA makes of it on each platform (GPU/TPU: their GEMM libraries).
- "cpu_kernel": specjax's own XLA FFI handler on the CPU (`cpu_kernels/matmul.cc`, built by
  `pip install`), streaming each weight once per tile of rows, on the best path the CPU has (chosen at
  run time, `kernel_path`): AMX tiles for bfloat16 where the CPU has AMX-BF16 (K a multiple of 32),
  AVX-512 (float32 FMA; bfloat16 by AVX512_BF16 dot products, float32 accumulation), else AVX2+FMA
  (float32 FMA; bfloat16 widened to float32 in registers, FMA in float32), else a portable loop.
  XLA:CPU multiplies a handful of rows far below the machine's peak (bfloat16 5-30 times slower than
  float32), so there a pass over K + 1 tokens cost several single-token steps; through the kernel it
  costs about what one does. It is batch-invariant: a row's result does not depend on how many rows
  are multiplied with it (a verify pass computes bit for bit what a one-token step computes; each path
  is, though two paths may differ in the last bits). Quantized
  weights (`quantized.QuantizedWeight`: int8, int4:G) have handlers of their own that read the codes
  and unpack them in registers: AVX-512 (int8 widened to float32, FMA with x in float32; int4 at G =
  32, 64, 128 with bfloat16 x turned into float32 integers by a table, FMA sums per group in the order of
  AVX512_BF16's dot products), else AVX2+FMA (codes and x widened to float32), else the portable loop;
  int4a8 (int4 codes, x quantized to int8 per group at run time) AVX512-VNNI integer dot products at G =
  32, 64, 128, else the portable loop, the two bit for bit the same (`quantized` has the definition). A
  `custom_vjp` makes it differentiable (the backward runs XLA's matmuls; for quantized weights, the XLA
  path's gradients).

`ModelConfig.matmul` holds the resolved backend; `backend_for` resolves the setting "auto": the kernel
for bfloat16 weights on a CPU where it runs vectorised (AVX512_BF16, or AVX2+FMA) and for quantized
weights (either dtype) on one with AVX2+FMA, XLA everywhere else (GPUs and TPUs are untouched). XLA:CPU
runs quantized weights by dequantizing tiles, several times the kernel's time (docs/quantized-drafts.md
has the measurements).

Measured on CPUs without AMX, the kernel's bfloat16 beat XLA's bfloat16 many times over and its float32 was
not clearly faster than XLA's float32, so "auto" leaves float32 on XLA and sends bfloat16 through the kernel
(`cpu_kernel` asks for the kernel anyway); docs/devices.md has the measurements, per path and whole-model.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.machinery
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import quantized
from specjax.models.config import MATMUL_BACKENDS

SETTINGS = ("auto",) + MATMUL_BACKENDS  # what the `matmul` config field takes
KERNEL_DTYPES = ("float32", "bfloat16")  # model dtypes the kernel multiplies in (x's dtype on its path)
AUTO_DTYPES = ("bfloat16",)  # float weights' dtypes "auto" runs through the kernel (see the module docstring)
_LIBRARY = "_cpu_kernels"  # the extension setup.py builds beside this module
_HANDLERS = {  # (weights: their dtype or format's bits, x's dtype) -> (FFI target, the library's handler)
    ("float32", "float32"): ("specjax_matmul_f32", "SpecjaxMatmulF32"),
    ("bfloat16", "bfloat16"): ("specjax_matmul_bf16", "SpecjaxMatmulBf16"),
    (8, "float32"): ("specjax_matmul_int8_f32", "SpecjaxMatmulInt8F32"),
    (8, "bfloat16"): ("specjax_matmul_int8_bf16", "SpecjaxMatmulInt8Bf16"),
    (4, "float32"): ("specjax_matmul_int4_f32", "SpecjaxMatmulInt4F32"),
    (4, "bfloat16"): ("specjax_matmul_int4_bf16", "SpecjaxMatmulInt4Bf16"),
    ("int4a8", "float32"): ("specjax_matmul_int4a8_f32", "SpecjaxMatmulInt4a8F32"),
    ("int4a8", "bfloat16"): ("specjax_matmul_int4a8_bf16", "SpecjaxMatmulInt4a8Bf16"),
}
_TAKE_ROWS = ("specjax_take_rows_bf16", "SpecjaxTakeRowsBf16")  # bfloat16 rows by index (`take_rows`)
# Where specjax_cpu_features holds each kind of weight's path (2 bits): float32, bfloat16, quantized
# (int8 and int4, with float32 or bfloat16 x), int4a8 (x quantized to int8 at run time; its path at G = 32).
_FEATURE_SHIFT = {"float32": 0, "bfloat16": 2, "quantized": 4, "int4a8": 6}
_PATHS = {  # what each path number means, per kind; 0 is the portable loop
    "float32": {1: "AVX2+FMA", 2: "AVX-512F"},
    "bfloat16": {1: "AVX2+FMA, bfloat16 widened to float32", 2: "AVX512_BF16",
                 3: "AMX tiles (AVX512_BF16 where K is not a multiple of 32)"},
    "quantized": {1: "AVX2+FMA, codes unpacked to float32 in registers",
                  2: "AVX-512: int8 and int4 codes unpacked to float32, FMA in float32"},
    "int4a8": {2: "AVX512-VNNI: x quantized to int8 per group, integer dot products (VPDPBUSD)"},
}
_NEEDS = {
    "float32": "AVX2+FMA or AVX-512F", "bfloat16": "AVX2+FMA or AVX512_BF16", "quantized": "AVX2+FMA or AVX512_BF16",
    "int4a8": "AVX512-VNNI (AVX512_VNNI with AVX512BW)"
}


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
  """The kernel library with its handlers registered for the CPU, or None and why it is unavailable."""
  here = pathlib.Path(__file__).parent
  found = [
      here / (_LIBRARY + suffix)
      for suffix in importlib.machinery.EXTENSION_SUFFIXES
      if (here / (_LIBRARY + suffix)).exists()
  ]
  if not found:
    return None, ("the CPU matmul kernel was not built (it builds with `pip install -e .` where a C++17 "
                  "compiler and jaxlib's FFI headers are present)")
  try:
    library = ctypes.CDLL(str(found[0]))
  except OSError as error:
    return None, f"the CPU matmul kernel {found[0].name} does not load: {error}"
  if not all(hasattr(library, symbol) for _, symbol in (*_HANDLERS.values(), _TAKE_ROWS)):  # older: fewer
    return None, f"the CPU matmul kernel {found[0].name} is an older build: rebuild it (`pip install -e .`)"
  for target, symbol in (*_HANDLERS.values(), _TAKE_ROWS):
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
  return library, ""


def _kind(dtype: str, weights: str) -> str:
  """The kind of weight the kernel multiplies for a model in `dtype` with weights in the format `weights`
  ("float", or a quantized format as `quantized.parse` takes it): its dtype, "int4a8" (x quantized at run
  time: its own path) or "quantized"."""
  if weights.strip() == "float":
    return dtype
  return "int4a8" if quantized.parse(weights).activations else "quantized"


def kernel_status(dtype: str, weights: str = "float") -> tuple[bool, str]:
  """(whether the kernel runs vectorised on this CPU for a `dtype` model with weights in the format
  `weights`, a phrase saying so or why not)."""
  library, why_not = _library()
  if library is None:
    return False, why_not
  if dtype not in KERNEL_DTYPES:
    return False, f"the CPU matmul kernel has no {dtype} path (it has {', '.join(KERNEL_DTYPES)})"
  kind = _kind(dtype, weights)
  path = kernel_path(kind)
  if not path:
    return False, f"this CPU lacks {_NEEDS[kind]}: the kernel's {kind} path would run its portable loop"
  return True, f"the CPU matmul kernel ({dtype if kind == dtype else f'{weights.strip()}, {dtype} x'}, " \
               f"{_PATHS[kind][path]})"


def kernel_path(kind: str) -> int:
  """The kernel's path for weights of `kind` ("float32", "bfloat16", "quantized" or "int4a8") on this CPU
  now: 0 the portable loop, 1 AVX2+FMA, 2 AVX-512, 3 AMX (bfloat16 with K a multiple of 32; what
  `specjax_cpu_features` reports; `kernel_limit` caps it;
  "quantized": int4 with bfloat16 x, whose AVX-512 path needs AVX512_BF16; int4 with float32 x runs AVX2;
  "int4a8": 2 is AVX512-VNNI, at G = 32, 64, 128; other G and CPUs run the portable loop)."""
  library = _library()[0]
  if library is None or kind not in _FEATURE_SHIFT:
    return 0
  return (library.specjax_cpu_features() >> _FEATURE_SHIFT[kind]) & 3


def kernel_limit(level: int) -> int:
  """Caps the kernel's path at `level` (0 portable, 1 AVX2+FMA, 2 AVX-512, 3 AMX: the default) for every later
  call, compiled programs included (a call reads the cap when it starts); returns the previous cap. For
  tests and measurements: a path's results are batch-invariant, but two paths may differ in the last bits."""
  library, why_not = _library()
  if library is None:
    raise RuntimeError(why_not)
  return int(library.specjax_cpu_limit(int(level)))


def backend_for(setting: str, dtype: str, platform: str | None = None, weights: str = "float") -> str:
  """`ModelConfig.matmul` for the setting `matmul` (one of SETTINGS) with a model in `dtype` on
  `platform` (None: this one), its weights stored in the format `weights` (`quantized.parse`). "auto"
  takes the kernel on a CPU where it runs vectorised, for float weights in AUTO_DTYPES and for quantized
  weights in either dtype (the module docstring says why); "cpu_kernel" where it cannot run is an error
  naming the reason."""
  if setting not in SETTINGS:
    raise ValueError(f"matmul must be one of {SETTINGS}, got {setting!r}")
  on_cpu = (platform or jax.default_backend()) == "cpu"
  if setting == "xla" or (setting == "auto" and not on_cpu):
    return "xla"
  if setting == "cpu_kernel" and not on_cpu:
    raise ValueError(f"matmul='cpu_kernel' runs on the CPU only, not on {platform or jax.default_backend()}")
  runs, why = kernel_status(dtype, weights)
  if setting == "auto":
    return "cpu_kernel" if runs and (weights.strip() != "float" or dtype in AUTO_DTYPES) else "xla"
  if _library()[0] is None or dtype not in KERNEL_DTYPES:
    raise ValueError(f"matmul='cpu_kernel': {why}")
  return "cpu_kernel"


def describe(backend: str, dtype: str, weights: str = "float") -> str:
  """What a model with `ModelConfig.matmul = backend` multiplies with, for run stats."""
  return kernel_status(dtype, weights)[1] if backend == "cpu_kernel" else "XLA's dot_general"


def dense(x_xK: jax.Array, weight_NxK: jax.Array | quantized.QuantizedWeight, backend: str,
          out_dtype=None) -> jax.Array:
  """x W^T [..., N] for x [..., K] and W [N, K], accumulated in float32 and returned in `out_dtype`
  (None: x's dtype after promotion with W's, as `dot_general` returns). x is cast to the weights' dtype
  on the kernel path (both operands in the weights' precision; a quantized W's is its model's dtype,
  the dtype it dequantizes to). A quantized W (`quantized.QuantizedWeight`) multiplies through the
  kernel, which unpacks its codes in registers, or on XLA (`QuantizedWeight.dense`)."""
  if backend == "xla":
    if isinstance(weight_NxK, quantized.QuantizedWeight):
      return weight_NxK.dense(x_xK, out_dtype)
    return jax.lax.dot_general(x_xK, weight_NxK, (((x_xK.ndim - 1,), (1,)), ((), ())), preferred_element_type=out_dtype)
  out_dtype = out_dtype or jnp.promote_types(x_xK.dtype, weight_NxK.dtype)
  lead = x_xK.shape[:-1]
  y_MxN = _kernel_matmul(x_xK.reshape(-1, x_xK.shape[-1]).astype(weight_NxK.dtype), weight_NxK)
  return y_MxN.reshape(*lead, weight_NxK.shape[0]).astype(out_dtype)


def _handler(x_MxK: jax.Array, weight_NxK: jax.Array | quantized.QuantizedWeight) -> tuple[str, tuple]:
  """The FFI target for these operands and the arrays it takes (a quantized W: its codes and scales)."""
  dtype = jnp.dtype(x_MxK.dtype).name
  if isinstance(weight_NxK, quantized.QuantizedWeight):
    fmt = weight_NxK.format
    key, operands = ("int4a8" if fmt.activations else fmt.bits, dtype), (x_MxK, weight_NxK.codes, weight_NxK.scales)
  else:
    key, operands = (jnp.dtype(weight_NxK.dtype).name, dtype), (x_MxK, weight_NxK)
  if key not in _HANDLERS or jnp.dtype(weight_NxK.dtype) != x_MxK.dtype:
    raise ValueError(f"the CPU matmul kernel multiplies float32 or bfloat16 x by weights of its dtype (float, "
                     f"int8 or int4), got {x_MxK.dtype} x {weight_NxK.dtype} weights")
  return _HANDLERS[key][0], operands


@jax.custom_vjp
def _kernel_matmul(x_MxK: jax.Array, weight_NxK: jax.Array | quantized.QuantizedWeight) -> jax.Array:
  """Float32 x W^T [M, N] through the FFI handler of W's kind and x's dtype."""
  target, operands = _handler(x_MxK, weight_NxK)
  _library()
  out = jax.ShapeDtypeStruct((x_MxK.shape[0], weight_NxK.shape[0]), jnp.float32)
  return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*operands)


def _kernel_forward(x_MxK, weight_NxK):
  return _kernel_matmul(x_MxK, weight_NxK), (x_MxK, weight_NxK)


def _kernel_backward(residuals, dy_MxN):
  """dx = dy W and dW = dy^T x, by XLA with float32 accumulation, in the operands' dtypes; a quantized W
  takes the XLA path's own gradients (dx, and its scales'; none for its integer codes; int4a8 int4's: the
  rounding of x passes gradients straight through)."""
  x_MxK, weight_NxK = residuals
  if isinstance(weight_NxK, quantized.QuantizedWeight):
    float_x = weight_NxK.replace(format=dataclasses.replace(weight_NxK.format, activations=0))
    _, vjp = jax.vjp(lambda x, scales: float_x.replace(scales=scales).dense(x, jnp.float32), x_MxK, weight_NxK.scales)
    dx_MxK, dscales = vjp(dy_MxN)
    return dx_MxK, weight_NxK.replace(codes=np.zeros(weight_NxK.codes.shape, jax.dtypes.float0), scales=dscales)
  dx_MxK = jax.lax.dot_general(dy_MxN.astype(weight_NxK.dtype), weight_NxK, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
  dw_NxK = jax.lax.dot_general(dy_MxN.astype(x_MxK.dtype), x_MxK, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
  return dx_MxK.astype(x_MxK.dtype), dw_NxK.astype(weight_NxK.dtype)


_kernel_matmul.defvjp(_kernel_forward, _kernel_backward)


@jax.custom_vjp
def take_rows(table_VxD: jax.Array, ids_x: jax.Array) -> jax.Array:
  """Rows `ids_x` (clamped into [0, V)) of a bfloat16 table [V, D], [..., D], copied by the kernel library:
  XLA:CPU's gather widens the whole table first (`transformer.take_rows`). Differentiable in the table."""
  _library()
  out = jax.ShapeDtypeStruct((ids_x.size, table_VxD.shape[1]), table_VxD.dtype)
  rows_NxD = jax.ffi.ffi_call(_TAKE_ROWS[0], out, vmap_method="sequential")(table_VxD,
                                                                            ids_x.reshape(-1).astype(jnp.int32))
  return rows_NxD.reshape(*ids_x.shape, table_VxD.shape[1])


def _take_rows_forward(table_VxD, ids_x):
  return take_rows(table_VxD, ids_x), (table_VxD, ids_x)


def _take_rows_backward(residuals, rows_xD):
  table_VxD, ids_x = residuals  # the table only for its shape and dtype: the zeros are made here, not forward
  return jnp.zeros_like(table_VxD).at[jnp.clip(ids_x, 0, table_VxD.shape[0] - 1)].add(rows_xD), None


take_rows.defvjp(_take_rows_forward, _take_rows_backward)
