"""GGUF loading: tiny random `transformers` models written as GGUF the way llama.cpp's converter does
(q/k rows permuted for llama, GPT-2's Conv1D weights transposed, Gemma's norms stored as 1 + w), read
back by specjax.

F32 files are compared with the original torch model; F16 and Q8_0 files with `transformers` loading
the same GGUF (so both sides see the same rounded weights). Logits within 1e-4, identical greedy
continuations of 32 tokens.
"""

import copy
import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from specjax.models.gguf_loader import load_gguf, unpermute_rows
from specjax.models.hf import config_from_hf_dict
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import forward
from tests.helpers.gguf import ARCH, gguf_tensors, llama_cpp_permute, write_gguf
from tests.helpers.tiny_hf import VOCAB, make_hf_model


@functools.partial(jax.jit, static_argnums=0)
def _logits(config, params, tokens_BxT):
  return forward(config, params, tokens_BxT, init_cache(config, tokens_BxT.shape[0], tokens_BxT.shape[1]))[0]


def greedy(logits_fn, prompts_BxP: np.ndarray, num_new: int) -> np.ndarray:
  """Greedy continuations [B, num_new]; `logits_fn` maps a fixed [B, P + num_new] buffer to causal logits."""
  B, P = prompts_BxP.shape
  buffer_BxS = np.zeros((B, P + num_new), np.int64)
  buffer_BxS[:, :P] = prompts_BxP
  for t in range(P, P + num_new):
    buffer_BxS[:, t] = np.argmax(np.asarray(logits_fn(buffer_BxS))[:, t - 1], axis=-1)
  return buffer_BxS[:, P:]


def rounded_like_gguf(model, qtype):
  """`model` with its 2-D weights rounded as the GGUF file stores them. (transformers' own GGUF path
  sizes GPT-2's position table from `n_ctx` instead of `n_positions`, so it cannot be the reference.)"""
  model = copy.deepcopy(model)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 2:
        conv1d = ".c_" in name  # Conv1D weights are [in, out]; the file quantizes [out, in] rows
        rows = p.numpy().T if conv1d else p.numpy()
        rounded = gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype)
        p.copy_(torch.from_numpy(np.ascontiguousarray(rounded.T if conv1d else rounded)))
  return model


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.numpy()


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
  """torch's intra-op threads fight XLA's for 2 cores: tiny forwards got 70x slower with both."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


CASES = [(f, "F32") for f in ARCH] + [("llama", "F16"), ("llama", "Q8_0"), ("qwen2", "Q8_0"), ("gpt2", "Q8_0"),
                                      ("gemma3_llama_cpp", "Q8_0")]


@pytest.mark.parametrize("family,qtype", CASES)
def test_gguf_matches_transformers(tmp_path, family, qtype):
  model = make_hf_model(family)
  write_gguf(str(tmp_path / "m.gguf"), family, model, gguf.GGMLQuantizationType[qtype])
  config, params = load_gguf(str(tmp_path / "m.gguf"))
  if family == "gpt2":  # the file carries its own copy of the tied head
    assert not config.tie_embeddings and config.max_positions == 256
  else:
    assert config == config_from_hf_dict(model.config.to_dict())
  if qtype != "F32":  # the reference sees the same rounded weights
    # transformers reads neither GPT-2 (see below) nor this Gemma 3 (it assumes query_pre_attn_scalar 256)
    model = (rounded_like_gguf(model, gguf.GGMLQuantizationType[qtype])
             if family in ("gpt2", "gemma3_llama_cpp") else transformers.AutoModelForCausalLM.from_pretrained(
                 str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval())
  ours = lambda tokens: _logits(config, params, jnp.asarray(tokens, jnp.int32))
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 7 + 32))  # one shape, one compile
  np.testing.assert_allclose(np.asarray(ours(tokens)), _torch_logits(model, tokens), atol=1e-4, rtol=0)
  np.testing.assert_array_equal(greedy(ours, tokens[:, :7], 32),
                                greedy(lambda b: _torch_logits(model, b), tokens[:, :7], 32))


def test_unpermute_inverts_llama_cpp_permute():
  w = np.random.default_rng(0).normal(size=(4 * 8, 5))
  permuted = llama_cpp_permute(w, 4)
  assert not np.array_equal(permuted, w)
  np.testing.assert_array_equal(unpermute_rows(permuted, 4), w)


def test_bfloat16_dtype(tmp_path):
  model = make_hf_model("qwen2")
  write_gguf(str(tmp_path / "m.gguf"), "qwen2", model)
  config, params = load_gguf(str(tmp_path / "m.gguf"), dtype="bfloat16")
  assert config.dtype == "bfloat16"
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}


@pytest.fixture(scope="module")
def llama_model():
  return make_hf_model("llama")


def _broken(tmp_path, llama_model, edit, **kwargs) -> str:
  tensors = gguf_tensors("llama", llama_model)
  edit(tensors)
  path = str(tmp_path / "broken.gguf")
  write_gguf(path, "llama", llama_model, tensors=tensors, **kwargs)
  return path


def test_missing_tensor(tmp_path, llama_model):
  path = _broken(tmp_path, llama_model, lambda t: t.pop("blk.1.ffn_up.weight"))
  with pytest.raises(ValueError, match=r"missing tensor.*layers_1/mlp/up_proj/weight"):
    load_gguf(path)


def test_extra_tensor(tmp_path, llama_model):
  path = _broken(
      tmp_path, llama_model, lambda t: t.update(
          {"blk.0.attn_q.bias": np.zeros(64, np.float32), "blk.0.mystery.weight": np.zeros(3, np.float32)}))
  with pytest.raises(ValueError, match=r"unexpected extra tensor 'blk.0.mystery.weight'"):
    load_gguf(path)


def test_shape_mismatch(tmp_path, llama_model):
  path = _broken(tmp_path, llama_model, lambda t: t.update({"blk.0.ffn_gate.weight": np.zeros((95, 64), np.float32)}))
  with pytest.raises(ValueError, match=r"shape mismatch for layers_0/mlp/gate_proj/weight.*\(95, 64\)"):
    load_gguf(path)


def test_unsupported_architecture(tmp_path, llama_model):
  path = _broken(tmp_path, llama_model, lambda t: None, arch="mamba")
  with pytest.raises(ValueError, match=r"unsupported architecture 'mamba'"):
    load_gguf(path)


def test_missing_and_non_gguf_files(tmp_path):
  with pytest.raises(ValueError, match="no such GGUF file"):
    load_gguf(str(tmp_path / "absent.gguf"))
  (tmp_path / "text.gguf").write_text("hello, not a model")
  with pytest.raises(ValueError, match="not a GGUF file"):
    load_gguf(str(tmp_path / "text.gguf"))
