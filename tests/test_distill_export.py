"""Exported drafts load in `transformers` with specjax's logits, and read back into specjax unchanged."""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file
import torch
import transformers

import ml_collections

from specjax.distill.export import export_hf
from specjax.distill.student import fresh, truncate
from specjax.distill.steps import logits
from specjax.models.config import ModelConfig
from specjax.models.hf import load_hf_dir
from specjax.models.load import load_model
from specjax.models.layout import stack_layers
from specjax.models.transformer import init_params
from tests.helpers.distill import save_tiny_target
from tests.helpers.tiny_hf import FAMILIES, VOCAB, save_hf_model

TOKENS = np.array([[5, 17, 3, 44, 9, 60, 2, 1], [90, 0, 33, 12, 7, 7, 8, 71]], np.int32)


def _assert_transformers_logits_match(directory, config, params):
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  with torch.no_grad():
    want = model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  got = np.asarray(logits(config, params, TOKENS))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trips_through_transformers(family, tmp_path):
  save_hf_model(family, str(tmp_path / "src"))
  config, params = load_hf_dir(str(tmp_path / "src"))
  params = jax.tree.map(lambda p: p + 0.01 * np.random.default_rng(0).normal(size=p.shape).astype(np.float32),
                        params)  # changed weights, as after training
  export_hf(str(tmp_path / "out"), config, params)
  _assert_transformers_logits_match(str(tmp_path / "out"), config, params)
  config_back, params_back = load_hf_dir(str(tmp_path / "out"))
  assert config_back == config
  jax.tree.map(np.testing.assert_array_equal, params_back, params)


@pytest.mark.slow
def test_export_of_a_windowed_qwen2_config(tmp_path):
  """Settings the families above do not cover: q/k/v biases with a sliding window shorter than the input."""
  config = ModelConfig(arch="llama", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                       d_ff=48, rope_theta=5e5, norm_eps=1e-5, qkv_bias=True, sliding_window=4)
  params = jax.tree.map(lambda p: p * 5, init_params(config, jax.random.key(0)))
  export_hf(str(tmp_path), config, params)
  _assert_transformers_logits_match(str(tmp_path), config, params)
  assert load_hf_dir(str(tmp_path))[0] == config


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen3"])
def test_truncated_and_fresh_students_export(family, tmp_path):
  """Students of a Gemma / Qwen3 target keep its per-layer pattern: the kept layers' when truncated,
  the target's continued when fresh and deeper; both load in `transformers` with specjax's logits."""
  save_hf_model(family, str(tmp_path / "src"))
  config, params = load_hf_dir(str(tmp_path / "src"))
  short_config, short_params = truncate(config, params, 2)
  assert short_config.layer_types == config.layer_types[:2]
  spec = ml_collections.ConfigDict(
      dict(d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48, tie_embeddings=True))
  deep_config, deep_params = fresh(config, spec, jax.random.key(1))
  assert deep_config.layer_types == tuple(
      config.layer_types[i % config.n_layers] for i in range(4) if config.layer_types)
  deep_params = jax.tree.map(lambda p: p + 0.1 * np.random.default_rng(2).normal(size=p.shape).astype(np.float32),
                             deep_params)
  for name, (student_config,
             student_params) in {"short": (short_config, short_params), "deep": (deep_config, deep_params)}.items():
    export_hf(str(tmp_path / name), student_config, student_params)
    _assert_transformers_logits_match(str(tmp_path / name), student_config, student_params)
    assert load_hf_dir(str(tmp_path / name))[0] == student_config


def test_export_writes_a_tokenizer_transformers_and_specjax_read(tmp_path):
  target = load_model(save_tiny_target(str(tmp_path / "src")))
  out = export_hf(str(tmp_path / "out"), target.config, target.params, target.tokenizer)
  text = "for i in range(3):\n    print(i)"
  assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == target.tokenizer.encode(text)
  reloaded = load_model(out)
  assert reloaded.tokenizer.fingerprint() == target.tokenizer.fingerprint()
  assert reloaded.tokenizer.eos_ids == target.tokenizer.eos_ids


def test_stacked_params_export_one_tensor_per_layer(tmp_path):
  """Params in the scanned layout (`layers` with a leading [L] axis) write the same files as per layer."""
  config = ModelConfig(arch="llama", vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                       d_ff=48)
  params = init_params(config, jax.random.key(0))
  export_hf(str(tmp_path / "layers"), config, params)
  export_hf(str(tmp_path / "stacked"), config.replace(scan_layers=True), stack_layers(params, 3))
  want, got = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("layers", "stacked"))
  assert sorted(got) == sorted(want) and "model.layers.2.mlp.up_proj.weight" in got
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  read = lambda name: json.loads((tmp_path / name / "config.json").read_text())
  assert read("stacked") == read("layers")
