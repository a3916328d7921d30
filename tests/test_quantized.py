"""Quantized weights (`specjax.models.quantized`) and the quantized drafter: the round trip stays within
half a scale of float64 truth; the quantized matmul equals a float64 matmul of the dequantized weights;
a quantized model computes what the model of its dequantized weights computes (tied head and stacked
layers included); greedy speculation with the target's own int8 / int4 copy as its draft equals the
target's greedy output on a ragged batch; bad formats fail with one line naming the field; int4a8 (x
quantized to int8 per group at run time) on XLA equals its definition (`int4a8_reference`), its integer
dot products exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decode_spec, lowering, metrics, pipeline, session, testing
from specjax.api import Decoder
from specjax.errors import ConfigError
from specjax.generation import as_token_lists
from specjax.models import load, matmul, quantized
from specjax.models.config import MATMUL_BACKENDS
from specjax.models.kv_cache import init_cache
from specjax.models.layout import to_layout
from specjax.models.load import load_model
from specjax.models.transformer import forward, output_head
from specjax.speculative.drafters.quantized import QuantizedDrafter
from specjax.speculative.loop import SpeculativeLoop
from tests.helpers.cli import cli_config, decode_in_process, model_dirs  # noqa: F401 (the fixture)
from tests.helpers.engine import BUDGETS, CACHE_LEN, OUT_WIDTH, PROMPTS, TARGET, target_greedy, tiny_model
from tests.helpers.gguf import write_gguf
from tests.helpers.quantized import (dequantized64, float64_scales, int4a8_exact_operands, int4a8_reference,
                                     random_weights, unpacked_codes)
from tests.helpers.tiny_hf import make_hf_model
from tests.helpers.tokenizers import add_tokenizer_metadata, train_tokenizer

FORMATS = ("int8", "int4", "int4:64", "int4:128")


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_error_is_at_most_half_a_scale(name):
  """Per output channel (int8) or group (int4), against float64: every element within scale / 2 of its
  weight, scale = max |w| / qmax up to the scale dtype's rounding, codes in [-qmax, qmax], an all-zero
  group exact; the library's own dequantization equals the float64 one; stacked layers ([2, N, K])
  quantize layer by layer."""
  fmt = quantized.parse(name)
  w = random_weights((2, 24, 256), seed=3)
  q = quantized.quantize(jnp.asarray(w), fmt)
  assert q.shape == w.shape and q.format == fmt
  assert q.scales.dtype == jnp.dtype(fmt.scale_dtype)
  group = fmt.group or w.shape[-1]
  assert q.scales.shape == (2, 24, 256 // group)
  codes, scales = unpacked_codes(q), float64_scales(q)
  assert np.abs(codes).max() <= fmt.qmax
  w_xNxGxE = w.astype(np.float64).reshape(2, 24, -1, group)
  error = np.abs(w_xNxGxE - dequantized64(q).reshape(w_xNxGxE.shape)).max(-1)
  assert np.all(error <= scales / 2 * (1 + 1e-6)), (error / scales).max()
  absmax = np.abs(w_xNxGxE).max(-1)
  live = absmax > 0
  relative = 2.0**-8 if fmt.scale_dtype == "bfloat16" else 1e-7  # the scale's own rounding
  np.testing.assert_allclose(scales[live], absmax[live] / fmt.qmax, rtol=relative)
  assert np.all(codes[..., 0, :32] == 0)  # the all-zero group
  assert np.any(codes == fmt.qmax) and np.any(codes == -fmt.qmax)  # the range is used
  # code * scale is exact in float32 for bfloat16 scales, rounded once for float32 ones
  np.testing.assert_allclose(np.asarray(q.dequantize(jnp.float32), np.float64), dequantized64(q),
                             rtol=0 if fmt.scale_dtype == "bfloat16" else 2.0**-24)
  layer = quantized.quantize(jnp.asarray(w[1]), fmt)
  np.testing.assert_array_equal(np.asarray(layer.codes), np.asarray(q.codes[1]))


@pytest.mark.parametrize("name", FORMATS)
def test_quantized_dense_equals_a_float64_matmul_of_the_dequantized_weights(name):
  """`matmul.dense` dispatches on the quantized leaf for the backend the model names (the CPU kernel,
  which unpacks the codes; XLA's path on the CPU, two tiles of CPU_ROWS rows and the rest) and the other
  platforms' path (one pass over W) computes the same; x [2, 3, K] float32 against float64 truth."""
  q = quantized.quantize(jnp.asarray(random_weights((2 * quantized.CPU_ROWS + 44, 256), seed=5)), quantized.parse(name))
  x = np.random.default_rng(6).normal(size=(2, 3, 256)).astype(np.float32)
  expected = x.astype(np.float64) @ dequantized64(q).T
  for got in [matmul.dense(jnp.asarray(x), q, backend) for backend in MATMUL_BACKENDS
             ] + [q._whole(jnp.asarray(x), jnp.float32)]:
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
  assert matmul.dense(jnp.asarray(x), q, "xla", jnp.float32).dtype == jnp.float32


def _logits(config, params):
  tokens = jnp.asarray([[5, 17, 3, 44, 9, 1], [1, 2, 60, 7, 7, 7]], jnp.int32)
  return np.asarray(jax.jit(forward, static_argnums=0)(config, params, tokens, init_cache(config, 2, 8))[0])


@pytest.mark.parametrize("name, tied, stacked, backend", [("int4", False, False, "cpu_kernel"),
                                                          ("int4", True, True, "xla")])
def test_a_quantized_model_computes_what_its_dequantized_weights_compute(name, tied, stacked, backend):
  """The forward of the quantized params equals the forward of the same model whose weights are their
  dequantized values (float32 rounding apart), and differs from the float model's, on XLA and through
  the CPU kernel; every linear weight and the head are quantized, the embedding not (a tied model gains
  its quantized head as lm_head)."""
  config, params = tiny_model(2, n_layers=2)
  config = config.replace(matmul=backend)
  if tied:
    config, params = config.replace(tie_embeddings=True), {k: v for k, v in params.items() if k != "lm_head"}
  q = quantized.quantize_params(config, params, quantized.parse(name))
  assert isinstance(output_head(config, q), quantized.QuantizedWeight)
  assert not isinstance(q["embed"]["embedding"], quantized.QuantizedWeight)
  kinds = {
      path: isinstance(leaf, quantized.QuantizedWeight) for path, leaf in jax.tree_util.tree_flatten_with_path(
          q, is_leaf=lambda n: isinstance(n, quantized.QuantizedWeight))[0]
  }
  assert all(is_q == (path[-1].key == "weight") for path, is_q in kinds.items())
  assert sum(kinds.values()) == 2 * 7 + 1
  if stacked:
    config = config.replace(scan_layers=True)
    q = to_layout(config, q)
  got, expected = _logits(config, q), _logits(config, quantized.dequantized_params(q))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  assert np.abs(got - _logits(config, to_layout(config, params))).max() > 1e-3


@pytest.mark.parametrize("name, backend", [("int8", "xla"), ("int4", "xla"), ("int4a8", "cpu_kernel")])
def test_greedy_speculation_with_the_targets_quantized_copy_equals_target_greedy(name, backend):
  """The quantized drafter (its own cache, the target's weights as `name`, multiplied on `backend`: int4a8
  through the kernel's int4a8 handler) keeps greedy output token for token on a ragged batch with budgets
  that cut blocks; int8 is accepted almost always, int4 less."""
  config, params = TARGET
  draft_config = config.replace(matmul=backend)
  drafter = QuantizedDrafter(draft_config, quantized.quantize_params(draft_config, params, quantized.parse(name)))
  out = testing.speculate(SpeculativeLoop(config, 3, OUT_WIDTH), params, drafter, testing.request(PROMPTS, BUDGETS),
                          cache_len=CACHE_LEN)
  assert as_token_lists(out.tokens, out.counts) == target_greedy()
  total = metrics.summarize(out.acceptance)["total"]
  assert 0 < total["accepted"] <= total["proposed"]
  if name == "int8":
    assert total["acceptance_rate"] > 0.8


def test_the_xla_path_shows_in_the_lowering_for_a_gpu():
  """`lowering.report` counts the dequantizations of a program lowered for CUDA: per matmul (two layers of
  seven, and the head) one for int8, two for int4 (one per half of its groups), none for float weights."""
  config, params = tiny_model(2, n_layers=2)
  tokens = jnp.ones((1, 2), jnp.int32)
  for fmt, count in ((None, 0), (quantized.INT8, 15), (quantized.parse("int4"), 30)):
    q = quantized.quantize_params(config, params, fmt)
    lowered = jax.jit(forward, static_argnums=0).trace(config, q, tokens,
                                                       init_cache(config, 1, 8)).lower(lowering_platforms=("cuda",))
    assert lowering.report(lowered)["weight_dequantizations"] == count


@pytest.mark.parametrize("overrides, message", [
    (dict(weights="int3"), r"config.weights: 'int3' is not a weight format"),
    (dict(weights="int4:16"), r"config.weights: 'int4:16': an int4 group width G must be an even integer in 32..128"),
    (dict(weights="int4:65"), r"config.weights: 'int4:65'"),
    (dict(weights="int4a8:16"), r"config.weights: 'int4a8:16': an int4a8 group width G must be an even integer"),
    (dict(weights="int4", mesh="data=1"), r"config.weights 'int4': quantized weights on a mesh"),
    (dict(model=dict(weights="nf4")), r"config.model.weights: 'nf4' is not a weight format"),
    (dict(drafter="quantized", quantized=dict(weights="int2")), r"config.quantized.weights: 'int2'"),
])
def test_bad_weight_formats_fail_before_any_model_loads(overrides, message):
  with pytest.raises(ConfigError, match=message):
    decode_spec.from_config(cli_config(["no-target", "no-draft"], **overrides))


def test_the_quantized_drafter_builds_from_the_config_and_widths_are_checked_at_load(model_dirs):
  """`drafter = "quantized"` needs no draft model and drafts with the target's quantized weights on the
  target's matmul backend; a group that does not divide a width (the tiny models' d_ff is 96) fails with
  one line naming the field, for the target, a draft model and the drafter (`python -m specjax.decode`
  prints it alone); a Decoder refuses a run that changes the draft's weight format (it would need
  another load)."""
  spec = decode_spec.from_config(cli_config([model_dirs[0], ""], drafter="quantized"))
  assert not spec.loads_draft_model
  target, draft = pipeline.load_models(spec, log=lambda m: None)
  built = session.build_drafter(spec, target, draft, log=lambda m: None)
  assert draft is None and isinstance(built.drafter, QuantizedDrafter) and built.info["draft_weights"] == "int4:32"
  assert built.drafter.config == target.config
  head = output_head(built.drafter.config, built.drafter.params)
  assert isinstance(head, quantized.QuantizedWeight) and head.format == quantized.parse("int4")
  wide = cli_config([model_dirs[0], ""], drafter="quantized", quantized=dict(weights="int4:64"))
  with pytest.raises(
      ConfigError, match=r"^config.quantized.weights: int4:64: groups of 64 do not divide an input "
      r"width of 96 \(d_ff\)$"):
    session.build_drafter(decode_spec.from_config(wide), target, None, log=lambda m: None)
  with pytest.raises(ConfigError, match=r"^config.model.weights: int4:64: groups of 64 .* \(d_ff\)$"):
    pipeline.load_models(decode_spec.from_config(cli_config(model_dirs, model=dict(weights="int4:64"))),
                         log=lambda m: None, target=target)
  decoder = Decoder(config=cli_config(model_dirs, model=dict(weights="int8")))
  assert isinstance(output_head(decoder.draft.config, decoder.draft.params), quantized.QuantizedWeight)
  with pytest.raises(ConfigError, match=r"config.model.weights changes the loaded models \('int8' -> 'int4'\)"):
    decoder.run(model=dict(weights="int4"))
  status, stderr = decode_in_process([
      "--config=configs/tiny.py", f"--config.target={model_dirs[0]}", "--config.mode=autoregressive",
      "--config.weights=int4:64"
  ])
  assert (status, stderr.strip()) == (2, "error: config.weights: int4:64: groups of 64 do not divide an input "
                                      "width of 96 (d_ff)")


def test_quantized_weights_are_cached_beside_the_converted_gguf(tmp_path, monkeypatch):
  """A GGUF loaded with `weights` quantizes once and writes its codes and scales beside the converted
  float32 cache; the next load reads them (nothing quantized, the quantized weights' float tensors not
  read) and gives the same params; another format or dtype is another file."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  path = str(tmp_path / "tiny.gguf")
  write_gguf(path, "qwen2", make_hf_model("qwen2"),
             add_metadata=lambda w: add_tokenizer_metadata(w, train_tokenizer("qwen2"), "qwen2"))
  first = load_model(path, weights="int4")
  files = sorted(p.name for p in (tmp_path / "cache" / "converted").glob("*/weights-*"))
  assert files == ["weights-int4-32-float32.safetensors"]
  monkeypatch.setattr(quantized, "quantize", lambda *a, **k: pytest.fail("quantized again"))
  read, original = [], load._read_safetensors

  def recording(file, skip=()):
    meta, tensors = original(file, skip)

    def recorded():
      for name, array in tensors:
        read.append(name)
        yield name, array

    return meta, recorded()

  monkeypatch.setattr(load, "_read_safetensors", recording)
  again = load_model(path, weights="int4")
  assert "layers_0/mlp/down_proj/weight" not in read and "embed/embedding" in read
  quantized_leaf = lambda node: isinstance(node, quantized.QuantizedWeight)
  assert jax.tree.structure(again.params,
                            is_leaf=quantized_leaf) == jax.tree.structure(first.params, is_leaf=quantized_leaf)
  jax.tree.map(np.testing.assert_array_equal, again.params, first.params)
  a8 = load_model(path, weights="int4a8")
  assert quantized.describe(a8.params) == "int4a8:32"
  for leaf, int4_leaf in zip(jax.tree.leaves(a8.params), jax.tree.leaves(first.params)):  # codes and scales
    np.testing.assert_array_equal(leaf, int4_leaf)
  monkeypatch.undo()
  assert sorted(p.name for p in (tmp_path / "cache" / "converted").glob("*/weights-*")) == files


def test_int4a8_formats_parse_and_store_int4s_codes():
  """"int4a8" is int4:32's codes and scales with x quantized at run time: its own name (the stats), the
  same bytes (the same cached file: `stored`); bad group widths fail in one line, as int4's."""
  fmt = quantized.parse("int4a8")
  assert (fmt.name, fmt.group, fmt.activations) == ("int4a8:32", 32, 8)
  assert quantized.parse(" int4a8:64 ").name == "int4a8:64" and quantized.parse("int4:64").name == "int4:64"
  for bad in ("int4a8:16", "int4a8:65", "int4a8:x", "int4a8:"):
    with pytest.raises(quantized.FormatError, match=r"an int4a8 group width G must be an even integer in 32..128$"):
      quantized.parse(bad)
  with pytest.raises(quantized.FormatError, match=r"'int4a4' is not a weight format; expected one of .*int4a8:G"):
    quantized.parse("int4a4")
  w = jnp.asarray(random_weights((24, 128), seed=4))
  a8, int4 = quantized.quantize(w, fmt), quantized.quantize(w, quantized.parse("int4"))
  np.testing.assert_array_equal(np.asarray(a8.codes), np.asarray(int4.codes))
  np.testing.assert_array_equal(np.asarray(a8.scales), np.asarray(int4.scales))
  assert quantized.describe({"w": a8}) == "int4a8:32" and fmt.stored == quantized.parse("int4")


@pytest.mark.parametrize("name", ["int4a8", "int4a8:64"])
def test_int4a8_on_xla_equals_its_definition(name):
  """The XLA path (`QuantizedWeight.dense`: on the CPU two tiles of CPU_ROWS rows and the rest) against
  `int4a8_reference`: x's codes and scales bit for bit (XLA's rewrite of a division into a multiply by a
  rounded reciprocal, or jnp.round's ties taken away from zero, changes codes), the result within float32
  rounding of the float64 sum (x [2, 3, K] with groups of very different magnitudes and an all-zero one: d
  taken from the wrong group is off by whole terms), and exactly the integer sum on exact operands (ties
  everywhere: a rounding of ties away from zero is off by whole codes)."""
  fmt = quantized.parse(name)
  K = 4 * fmt.group
  q = quantized.quantize(jnp.asarray(random_weights((2 * quantized.CPU_ROWS + 44, K), seed=5)), fmt)
  rng = np.random.default_rng(6)
  x = rng.normal(size=(2, 3, K)) * np.repeat([1e-3, 30.0, 0.0, 1.0], fmt.group)
  x = jnp.asarray(x, jnp.bfloat16)
  want, magnitude, codes = int4a8_reference(x.reshape(6, K), q)
  got_codes, got_d = quantized.quantize_activations(x, fmt.group)
  np.testing.assert_array_equal(np.asarray(got_codes).reshape(codes.shape), codes)
  np.testing.assert_array_equal(
      np.asarray(got_d).reshape(6, -1),
      np.abs(np.asarray(x, np.float32).reshape(6, -1, fmt.group)).max(-1) / np.float32(127))
  got = np.asarray(jax.jit(matmul.dense, static_argnums=(2, 3))(x, q, "xla", jnp.float32), np.float64).reshape(6, -1)
  assert np.all(np.abs(got - want) <= (K // fmt.group + 4) * 2.0**-24 * magnitude + 1e-30)
  x, q, exact = int4a8_exact_operands(name, 5, 7, 3, seed=7)
  np.testing.assert_array_equal(np.asarray(matmul.dense(x, q, "xla", jnp.float32)), exact)
