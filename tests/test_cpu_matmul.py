"""The CPU matmul kernel (`specjax.models.matmul`, `cpu_kernels/matmul.cc`): equal to XLA's matmul
(float32 within 1e-5 relative; bfloat16 within float32 rounding of the bfloat16 products) on ragged
shapes, inside loops; quantized weights (int8, int4:G) within float32 rounding of a float64 product
with their dequantized values, int4a8 (x quantized to int8 per group) its definition (integer dots
exactly), the same bits on the portable and VNNI paths; batch-invariant bit for bit; differentiable;
models through it equal `transformers`, and greedy speculative decoding through it equals greedy
autoregressive decoding in bfloat16 too; "auto" and the config fall back to XLA, or fail in one line,
where it is not built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decode_config, decode_spec
from specjax.errors import ConfigError
from specjax.models import matmul, quantized, transformer
from specjax.models.hf import load_hf_dir
from specjax.models.kv_cache import init_cache
from tests.helpers import engine
from tests.helpers.quantized import dequantized64, random_weights
from tests.helpers.tiny_hf import VOCAB, save_hf_model
from tests.helpers.quantized import int4a8_exact_operands, int4a8_reference

# CI builds the kernel with the package (`pip install -e .`): a missing build fails here, not skips.
KERNEL = "cpu_kernel"
# (M, N, K): tails of every tile; K a multiple of 32 (AMX) with N tails and M past one 16-row group
SHAPES = [(1, 7, 5), (3, 33, 17), (6, 130, 67), (17, 64, 96), (2, 257, 1031), (3, 37, 64), (20, 50, 128)]
# int4:56: each half of a group is 28 bytes, so every group ends in a partial step of the vector path
QUANTIZED = ("int8", "int4", "int4:56", "int4:64", "int4:128")
PATH_NAMES = {0: "portable", 1: "avx2", 2: "avx512", 3: "amx"}
dense = jax.jit(matmul.dense, static_argnums=(2, 3))


def _operands(M, N, K, dtype, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((M, K)), dtype), jnp.asarray(rng.standard_normal((N, K)), dtype))


def _paths_here(dtype):
  """The kernel's paths this CPU runs for `dtype` (each level the cap `kernel_limit` can select)."""
  if matmul._library()[0] is None:
    return []
  here = []
  for level in PATH_NAMES:
    previous = matmul.kernel_limit(level)
    try:
      if matmul.kernel_path(dtype) == level:
        here.append(level)
    finally:
      matmul.kernel_limit(previous)
  return here


def _capped_at(level, kinds=matmul.KERNEL_DTYPES, request=None):
  """Caps the kernel at path `level` for every kind of weight while a test runs; skips, saying why, where
  this CPU lacks that path for one of `kinds` (a CPU with AVX-512F but not AVX512_BF16 runs AVX2 for
  bfloat16; AMX is bfloat16's alone: a test of float32 only, by its `dtype` parameter, skips it)."""
  if level == 3:
    kinds = ("bfloat16",)
    if request is not None and getattr(request.node, "callspec", None) and \
        request.node.callspec.params.get("dtype", jnp.bfloat16) != jnp.bfloat16:
      pytest.skip("AMX multiplies bfloat16 only")
  missing = [d for d in kinds if level not in _paths_here(d)]
  if missing:
    pytest.skip(f"this CPU has no {PATH_NAMES[level]} path for {', '.join(missing)}")
  previous = matmul.kernel_limit(level)
  yield level
  matmul.kernel_limit(previous)


@pytest.fixture(params=[1, 2, 3], ids=["avx2", "avx512", "amx"])
def vector_path(request):
  """Each vector path this CPU has (an AVX-512 host runs its AVX2 path too, an AMX host all three)."""
  yield from _capped_at(request.param, request=request)


@pytest.fixture(params=[0, 1, 2, 3], ids=["portable", "avx2", "avx512", "amx"])
def path(request):
  """Each path this CPU has, the portable loop included."""
  yield from _capped_at(request.param, request=request)


@pytest.fixture(params=[0, 1, 2], ids=["portable", "avx2", "avx512"])
def quantized_path(request):
  """Each path the kernel has for quantized weights on this CPU (AVX-512: int8, and int4 with bfloat16 x at
  G = 32, 64, 128; the other int4 calls run AVX2 under that cap)."""
  yield from _capped_at(request.param, ("quantized",))


def test_kernel_is_built():
  library, why_not = matmul._library()
  assert library is not None, why_not


def test_a_vector_path_runs_on_x86():
  """x86-64 CPUs of the last decade have AVX2+FMA: there the kernel must not run its portable loop."""
  import platform
  if platform.machine() not in ("x86_64", "AMD64"):
    pytest.skip("not an x86-64 CPU")
  with open("/proc/cpuinfo") as cpuinfo:
    flags = set(next((line for line in cpuinfo if line.startswith("flags")), "").split())
  if not {"avx2", "fma"} <= flags:
    pytest.skip("this CPU lacks AVX2+FMA")
  for dtype in matmul.KERNEL_DTYPES:
    assert matmul.kernel_path(dtype) >= 1 and matmul.kernel_status(dtype)[0], matmul.kernel_status(dtype)
    assert matmul.backend_for("auto", "bfloat16", "cpu") == KERNEL
    assert matmul.kernel_path("quantized") >= 1 and matmul.kernel_status(dtype, "int4")[0]
    assert all(matmul.backend_for("auto", dtype, "cpu", weights) == KERNEL for weights in ("int8", "int4:64"))


@pytest.mark.parametrize("dtype", [jnp.float32])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_float32_equals_xla_and_float64(M, N, K, dtype, path):
  """Within float32 rounding of a float64 reference: K roundings of the sum of |products|."""
  x, w = _operands(M, N, K, jnp.float32)
  got, want = np.asarray(dense(x, w, KERNEL, None)), np.asarray(dense(x, w, "xla", None))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
  assert np.all(np.abs(got - exact) <= (K + 2) * 2.0**-24 * scale)


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_bfloat16_equals_float64_products(M, N, K, path):
  """Exact bfloat16 products summed in float32: within K float32 roundings of float64's sum (the
  reference converts bfloat16 to float64 exactly)."""
  x, w = _operands(M, N, K, jnp.bfloat16)
  got = np.asarray(dense(x, w, KERNEL, jnp.float32))
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
  assert np.all(np.abs(got - want) <= K * 2.0**-24 * scale + 1e-30)
  xla = np.asarray(dense(x, w, "xla", jnp.float32))
  np.testing.assert_allclose(got, xla, rtol=0, atol=1e-5 * np.abs(want).max())


def _quantized_operands(name, M, N, dtype, seed):
  """x [M, K] and W [N, K] in the format `name` dequantizing to `dtype`: int8 with K = 331 (five 64-code
  blocks, one step of 8 and a tail of 3), int4:G with three groups."""
  fmt = quantized.parse(name)
  K = 3 * fmt.group or 331
  q = quantized.quantize(jnp.asarray(random_weights((N, K), seed)), fmt, dtype)
  return jnp.asarray(np.random.default_rng(seed).standard_normal((M, K)), dtype), q


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_weights_equal_float64(name, dtype, quantized_path):
  """The kernel multiplies x by the dequantized weights (an int4 weight, code x bfloat16 scale, is exact
  in float32, also for bfloat16 x, where the XLA path rounds it to bfloat16; int8 scales the sum): within
  K + 2 float32 roundings of float64's sum of |products|, on every path. A swapped nibble, a scale of
  the wrong group or row, or a lost tail is off by whole weights. M = 7 and N = 13 leave tails of every
  tile."""
  x, q = _quantized_operands(name, 7, 13, dtype, seed=7)
  got = np.asarray(dense(x, q, KERNEL, jnp.float32))
  w = dequantized64(q)
  want = np.asarray(x, np.float64) @ w.T
  scale = np.abs(np.asarray(x, np.float64)) @ np.abs(w).T
  assert np.all(np.abs(got - want) <= (x.shape[1] + 2) * 2.0**-24 * scale + 1e-30)


SLICES = [(start, rows) for start in range(5) for rows in range(1, 13 - start)]  # of 12 rows


@jax.jit
def _alone_and_in_slices(x_12xK, weight):
  """Each of 12 rows of x times W alone, and every slice of SLICES, in one compiled program (the path cap
  is read when it runs, so each path reuses it)."""
  alone = [matmul.dense(x_12xK[m:m + 1], weight, KERNEL, jnp.float32) for m in range(12)]
  return alone, [matmul.dense(x_12xK[s:s + r], weight, KERNEL, jnp.float32) for s, r in SLICES]


@pytest.mark.parametrize("name", ["int8", "int4", "int4:56", "int4a8"])
def test_quantized_weights_batch_invariant(name, quantized_path):
  """Each of 12 rows multiplied alone equals, bit for bit, that row in a product of M = 1..12 rows
  starting at offsets 0..4: every position of a 6-row tile, tiles of every height, taking 2, 3 or 4 rows
  of W."""
  alone, parts = _alone_and_in_slices(*_quantized_operands(name, 12, 13, jnp.bfloat16, seed=8))
  alone = np.concatenate([np.asarray(row) for row in alone])
  for (start, rows), part in zip(SLICES, parts):
    np.testing.assert_array_equal(np.asarray(part), alone[start:start + rows], err_msg=f"rows {start}..{start + rows}")


@pytest.mark.parametrize("name", ["int8", "int4", "int4a8"])
def test_quantized_weights_batch_invariant_past_a_row_block(name, quantized_path):
  """A product of 100 rows, more than one of the kernel's 96-row blocks, equals bit for bit its rows
  multiplied alone (on each side of the block's end)."""
  x, q = _quantized_operands(name, 100, 13, jnp.bfloat16, seed=9)
  full = np.asarray(dense(x, q, KERNEL, jnp.float32))
  for m in (0, 95, 96, 99):
    np.testing.assert_array_equal(np.asarray(dense(x[m:m + 1], q, KERNEL, jnp.float32))[0], full[m], err_msg=f"row {m}")


@pytest.fixture(params=[0, 2], ids=["portable", "vnni"])
def int4a8_path(request):
  """Each path the kernel has for int4a8 on this CPU: the portable loop, AVX512-VNNI (G = 32, 64, 128)."""
  yield from _capped_at(request.param, ("int4a8",))


# groups per int4a8 weight, per G: 17 x 32 and 9 x 64 fill one block of 256 code bytes and part of another,
# 5 x 128 too; G = 56 runs the portable loop on every host
A8_GROUPS = {"int4a8": 17, "int4a8:64": 9, "int4a8:128": 5, "int4a8:56": 3}


@pytest.mark.parametrize("name", A8_GROUPS)
def test_int4a8_equals_its_definition(name, int4a8_path):
  """On each path, against `int4a8_reference`: on exact operands (every float operation exact, ties in
  every group) the integer sum bit for bit: a tie rounded away from zero, a swapped nibble, a lost - 8
  or a code in the wrong lane is off by whole units; on random ones (groups of very different magnitudes,
  an all-zero group) within float32 rounding of the float64 sum (groups + 4 roundings of the sum of |terms|):
  d or a scale of the wrong group is off by whole terms. M = 7 and N = 13 leave tails of every tile."""
  groups = A8_GROUPS[name]
  x, q, exact = int4a8_exact_operands(name, 7, 13, groups, seed=10)
  np.testing.assert_array_equal(np.asarray(dense(x, q, KERNEL, jnp.float32)), exact)
  fmt = quantized.parse(name)
  q = quantized.quantize(jnp.asarray(random_weights((13, groups * fmt.group), seed=11)), fmt, jnp.bfloat16)
  rng = np.random.default_rng(12)
  x = rng.standard_normal((7, groups * fmt.group)) * np.repeat(rng.choice([1e-3, 1.0, 30.0], groups), fmt.group)
  x[:, :fmt.group] = 0.0
  x = jnp.asarray(x, jnp.bfloat16)
  want, magnitude, _ = int4a8_reference(x, q)
  got = np.asarray(dense(x, q, KERNEL, jnp.float32), np.float64)
  assert np.all(np.abs(got - want) <= (groups + 4) * 2.0**-24 * magnitude + 1e-30)


def test_int4a8_paths_agree_bit_for_bit():
  """The portable loop runs the VNNI path's float operations in its order (matmul.cc): the same bits, for
  every G the vector path takes, with float32 and bfloat16 x, and over threads (N = 700: several chunks of W
  on XLA's pool); and each row alone (a 1-row tile) gives its bits in the 7-row product, with more than 16
  groups, so that a lane sums two terms (the batch-invariance tests above take 3 groups). A 1-row tile
  summing its 16 lanes in another order fails this test and those."""
  if matmul.kernel_path("int4a8") < 2:
    pytest.skip("this CPU has no AVX512-VNNI path for int4a8")
  for name, dtype in (("int4a8", jnp.bfloat16), ("int4a8:64", jnp.float32), ("int4a8:128", jnp.bfloat16)):
    fmt = quantized.parse(name)
    K = A8_GROUPS[name] * fmt.group
    q = quantized.quantize(jnp.asarray(random_weights((700, K), seed=13)), fmt, dtype)
    x = jnp.asarray(np.random.default_rng(14).standard_normal((7, K)), dtype)
    vector = np.asarray(dense(x, q, KERNEL, jnp.float32))
    previous = matmul.kernel_limit(0)
    try:
      portable = np.asarray(dense(x, q, KERNEL, jnp.float32))
    finally:
      matmul.kernel_limit(previous)
    np.testing.assert_array_equal(vector, portable, err_msg=name)
    alone = np.concatenate([np.asarray(dense(x[m:m + 1], q, KERNEL, jnp.float32)) for m in range(7)])
    np.testing.assert_array_equal(alone, vector, err_msg=name)


def test_int4a8_status_names_its_path_and_auto_falls_back_without_it():
  """int4a8's path shows in the status where the CPU has AVX512-VNNI (/proc/cpuinfo), "auto" takes the kernel
  there (for float32 models too, as for int4), and keeps such weights on XLA where the kernel would run its
  portable loop (capped below AVX-512 here)."""
  with open("/proc/cpuinfo") as cpuinfo:
    flags = set(next((line for line in cpuinfo if line.startswith("flags")), "").split())
  has_vnni = {"avx512_vnni", "avx512bw", "avx512vl"} <= flags
  assert (matmul.kernel_path("int4a8") == 2) == has_vnni
  runs, why = matmul.kernel_status("bfloat16", "int4a8:64")
  assert runs == has_vnni and ("AVX512-VNNI: x quantized to int8" in why if runs else "lacks AVX512-VNNI" in why)
  for dtype in matmul.KERNEL_DTYPES:  # quantized weights of either dtype take the kernel where it is vectorised
    assert matmul.backend_for("auto", dtype, "cpu", "int4a8") == (KERNEL if has_vnni else "xla")
  previous = matmul.kernel_limit(1)
  try:
    assert matmul.kernel_status("bfloat16", "int4a8")[1].startswith("this CPU lacks AVX512-VNNI")
    assert matmul.backend_for("auto", "bfloat16", "cpu", "int4a8") == "xla"
  finally:
    matmul.kernel_limit(previous)


def test_quantized_gradients_are_the_xla_paths():
  """The kernel's backward for a quantized W is the XLA path's: dx, and its scales' gradient."""
  x, q = _quantized_operands("int4", 3, 10, jnp.float32, seed=9)
  loss = lambda backend: lambda x, scales: jnp.sum(
      jnp.sin(matmul.dense(x, q.replace(scales=scales), backend, jnp.float32)))
  got, want = (jax.jit(jax.grad(loss(backend), argnums=(0, 1)))(x, q.scales) for backend in (KERNEL, "xla"))
  for g, v in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(v, np.float32), rtol=1e-2,
                               atol=1e-4 * float(jnp.abs(v.astype(jnp.float32)).max()))


def test_leading_axes_and_output_dtype():
  """[B, T, K] inputs (the models' shape), a bfloat16 result like `dot_general`'s, float32 on request."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, 3, 40)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((24, 40)), jnp.bfloat16)
  got = dense(x, w, KERNEL, None)
  assert got.shape == (2, 3, 24) and got.dtype == jnp.bfloat16
  want = dense(x, w, "xla", jnp.float32)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2**-7, atol=1e-2)
  assert dense(x, w, KERNEL, jnp.float32).dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_batch_invariant(dtype, vector_path):
  """Row m of a product over M rows is bitwise row m over any slice holding it: a verify pass computes
  what the one-token steps would (XLA's own float32 matmul is not: its sums depend on M)."""
  x, w = _operands(20, 300, 1536, dtype, seed=2)
  full = np.asarray(dense(x, w, KERNEL, jnp.float32))
  for start, rows in [(0, 1), (5, 1), (0, 2), (3, 3), (7, 6), (2, 9), (4, 16)]:
    part = np.asarray(dense(x[start:start + rows], w, KERNEL, jnp.float32))
    np.testing.assert_array_equal(part, full[start:start + rows])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_batch_invariant_in_every_tile_position(dtype, vector_path):
  """Each of 17 rows multiplied alone equals, bit for bit, that row in a product of M = 1..17 rows
  starting at offsets 0..5, so every row sits at every position of a 4- or 6-row tile, in tiles of every
  height and row blocks whose tiles take 2, 3 or 4 rows of W; K (1031) and N (67) leave tails. AMX
  takes K = 1024 (a multiple of 32, else the call runs AVX-512): every column of its 16-row B tiles,
  and a row in a second tile group."""
  x, w = _operands(17, 67, 1024 if vector_path == 3 else 1031, dtype, seed=5)
  alone = np.concatenate([np.asarray(dense(x[m:m + 1], w, KERNEL, jnp.float32)) for m in range(17)])
  for start in range(6):
    for rows in range(1, 18 - start):
      part = np.asarray(dense(x[start:start + rows], w, KERNEL, jnp.float32))
      np.testing.assert_array_equal(part, alone[start:start + rows], err_msg=f"rows {start}..{start + rows}")


def test_inside_while_loop_and_scan():
  x, w = _operands(4, 48, 32, jnp.float32, seed=3)

  def body(i, acc_MxN):
    return acc_MxN + matmul.dense(x * (i + 1).astype(jnp.float32), w, KERNEL)

  got = jax.jit(lambda: jax.lax.fori_loop(0, jnp.int32(3), body, jnp.zeros((4, 48), jnp.float32)))()
  want = 6.0 * dense(x, w, "xla", None)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
  stacked = jnp.stack([w, 2 * w])
  scanned, _ = jax.lax.scan(lambda c, wi: (c + matmul.dense(x, wi, KERNEL), None), jnp.zeros((4, 48)), stacked)
  np.testing.assert_allclose(np.asarray(scanned), np.asarray(3 * want / 6), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_gradients_equal_xla(dtype, tolerance):
  x, w = _operands(5, 24, 40, dtype, seed=4)
  loss = lambda backend: lambda x, w: jnp.sum(jnp.sin(matmul.dense(x, w, backend, jnp.float32)))
  got = jax.grad(loss(KERNEL), argnums=(0, 1))(x, w)
  want = jax.grad(loss("xla"), argnums=(0, 1))(x, w)
  for g, v in zip(got, want):
    assert g.dtype == v.dtype == dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(v, np.float32), rtol=tolerance,
                               atol=tolerance * float(jnp.abs(v.astype(jnp.float32)).max()))


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])  # biases on q/k/v, and everywhere (gpt2)
def test_model_logits_equal_transformers(family, tmp_path):
  """Every weight matmul through the kernel (q/k/v/o, MLP, output head): logits equal transformers'."""
  import torch

  hf_model = save_hf_model(family, str(tmp_path))
  config, params = load_hf_dir(str(tmp_path))
  config = config.replace(matmul=KERNEL)
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 11))
  with torch.no_grad():
    want = hf_model(torch.tensor(tokens)).logits.numpy()
  got, _ = jax.jit(transformer.forward, static_argnums=0)(config, params, jnp.asarray(tokens, jnp.int32),
                                                          init_cache(config, 2, 16))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_verify_pass_equals_single_steps_bitwise(dtype):
  """A 12-token pass of a ragged batch through the kernel computes each position's hidden state bit for
  bit as twelve one-token steps through the cache do: the kernel's matmuls, and norms and attention
  reduced position by position (`transformer.per_position`; the steps attend per query too). At this
  width XLA's reductions over a chunk sum in another order than over one row: with the matmuls alone
  (INVARIANT_WIDTH = 1) 11 of the 12 bfloat16 positions differed. In float32 an ulp of attention shows
  (bfloat16 rounds most away): with the steps not attending per query, 92% of the first position's
  values differed."""
  config, params = engine.tiny_model(0, d_model=1536, n_layers=2, scale=0.03)
  config = config.replace(dtype=dtype, matmul=KERNEL)
  params = jax.tree.map(lambda a: a.astype(dtype), params)
  forward = jax.jit(transformer.forward_hidden, static_argnums=0)
  T = 12
  tokens_2xP = jnp.asarray(np.random.default_rng(0).integers(0, engine.VOCAB, (2, 5 + T)), jnp.int32)
  _, cache = forward(config, params, tokens_2xP[:, :5], init_cache(config, 2, 32))
  cache = cache.advance(jnp.asarray([5, 3]))  # ragged: the second row's last two prompt tokens are dropped
  verify_2xTxD, _ = forward(config, params, tokens_2xP[:, 5:], cache)
  for t in range(T):
    step_2x1xD, cache = forward(config, params, tokens_2xP[:, 5 + t:6 + t], cache)
    cache = cache.advance(jnp.asarray([1, 1]))
    np.testing.assert_array_equal(np.asarray(step_2x1xD[:, 0]), np.asarray(verify_2xTxD[:, t]))


def test_bfloat16_greedy_speculative_equals_autoregressive():
  """In bfloat16 through the kernel, a (K + 1)-token verify pass computes each position bit for bit as
  the one-token steps do, so greedy speculative output is the target's greedy output token for token
  (with XLA's matmuls it may not be: their sums depend on how many rows are multiplied)."""
  to_bf16 = lambda model: (model[0].replace(dtype="bfloat16", matmul=KERNEL),
                           jax.tree.map(lambda a: a.astype(jnp.bfloat16), model[1]))
  target, draft = to_bf16(engine.TARGET), to_bf16(engine.DRAFTS["perturbed"])
  got = engine.run_speculative(draft, target=target, k=3)
  assert engine.as_token_lists(got.tokens, got.counts) == engine.target_greedy(target=target)
  assert int(np.asarray(got.acceptance.accepted).sum()) > 0  # rounds did draft and accept


def test_unbuilt_kernel_falls_back_or_fails_in_one_line(monkeypatch):
  matmul._library.cache_clear()
  monkeypatch.setattr(matmul, "_library", lambda: (None, "the CPU matmul kernel was not built"))
  assert matmul.backend_for("auto", "bfloat16", "cpu") == "xla"
  assert matmul.backend_for("auto", "float32", "cuda") == "xla"
  with pytest.raises(ValueError, match="matmul='cpu_kernel': the CPU matmul kernel was not built"):
    matmul.backend_for(KERNEL, "float32", "cpu")
  cfg = decode_config.default_config()
  cfg.target, cfg.prompts, cfg.matmul = "some/model", ("hi",), KERNEL
  with pytest.raises(ConfigError, match="^config.matmul='cpu_kernel': the CPU matmul kernel was not built"):
    decode_spec.from_config(cfg)


def test_settings_resolve():
  assert matmul.backend_for("auto", "float32", "tpu") == "xla"
  assert matmul.backend_for("xla", "bfloat16", "cpu") == "xla"
  assert matmul.backend_for("auto", "bfloat16", "cpu") == (KERNEL if matmul.kernel_status("bfloat16")[0] else "xla")
  with pytest.raises(ValueError, match="runs on the CPU only"):
    matmul.backend_for(KERNEL, "float32", "cuda")
  with pytest.raises(ValueError, match="matmul must be one of"):
    matmul.backend_for("mkl", "float32", "cpu")


@pytest.mark.skipif(matmul._library()[0] is None, reason="the CPU kernel library is not built")
def test_take_rows_copies_rows_bit_for_bit_and_differentiates():
  """`matmul.take_rows` (the embedding lookup of a bfloat16 model through the kernel) equals XLA's gather
  bit for bit, repeated, first and last rows included, and its gradient in the table is the gather's
  (a row written to the wrong slot, or gradients not summed over repeats, fail)."""
  table_VxD = jnp.asarray(np.random.default_rng(0).standard_normal((1000, 48)), jnp.bfloat16)
  ids_BxT = jnp.asarray([[3, 999, 0], [7, 7, 500]], jnp.int32)
  got = jax.jit(matmul.take_rows)(table_VxD, ids_BxT)
  want = jnp.take(table_VxD, ids_BxT, axis=0)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
  loss = lambda gather: lambda t: jnp.sum(gather(t).astype(jnp.float32)**2)
  np.testing.assert_array_equal(
      jax.grad(loss(lambda t: matmul.take_rows(t, ids_BxT)))(table_VxD),
      jax.grad(loss(lambda t: jnp.take(t, ids_BxT, axis=0)))(table_VxD))
