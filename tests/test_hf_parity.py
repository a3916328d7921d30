"""Logits of HF checkpoints loaded by specjax equal `transformers` (float32, max abs err <= 1e-4), and
greedy continuations equal `transformers.generate`, for every family of `tests.helpers.tiny_hf`
(prompts past the sliding windows and the RoPE scalings' original contexts)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from specjax.models import transformer
from specjax.models.hf import config_from_hf_dict, load_hf_dir
from specjax.models.kv_cache import init_cache
from specjax.models.layout import stack_layers
from tests.helpers.tiny_hf import FAMILIES, VOCAB, assert_greedy_matches_generate, save_hf_model

# One compiled forward per (config, shapes): op by op the file ran ~30% longer.
forward = jax.jit(transformer.forward, static_argnums=0)

# The cache tests run on the families whose attention or positions differ in a way a cache could get wrong:
# sliding windows and per-layer RoPE bases (gemma2/3), learned positions (gpt2), per-call dynamic RoPE, q/k
# norms (qwen3), and plain llama. The others differ from llama in functions of the absolute position (the
# other RoPE scalings) or of the weights alone (biases, tied embeddings, mistral without a window): the full
# forward and transformers' generate cover them.
CACHE_FAMILIES = ("llama", "gpt2", "llama_dynamic", "qwen3", "gemma2", "gemma3")
# Scanned layers look each layer's window and RoPE base up by the traced index: the families whose layers
# differ (gemma2, gemma3), and two whose layers are alike.
SCAN_FAMILIES = ("llama", "qwen3", "gemma2", "gemma3")


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, tmp_path_factory):
  directory = str(tmp_path_factory.mktemp(request.param))
  hf_model = save_hf_model(request.param, directory)
  config, params = load_hf_dir(directory)
  return hf_model, config, params


def _transformers_logits(hf_model, tokens: np.ndarray) -> np.ndarray:
  """transformers' logits of every position: one full forward, except under dynamic NTK RoPE, where
  transformers' frequencies depend on the length of each call: there one token per call through its
  cache (generate's decode steps), the semantics specjax gives every position (see `models.rope`)."""
  with torch.no_grad():
    if (getattr(hf_model.config, "rope_parameters", None) or {}).get("rope_type") != "dynamic":
      return hf_model(torch.tensor(tokens)).logits.numpy()
    cache, steps = None, []
    for t in range(tokens.shape[1]):
      out = hf_model(torch.tensor(tokens[:, t:t + 1]), cache=cache, use_cache=True)
      cache = out.past_key_values
      steps.append(out.logits.numpy())
    return np.concatenate(steps, axis=1)


def test_full_forward_matches_transformers(loaded):
  hf_model, config, params = loaded
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 23))
  want = _transformers_logits(hf_model, tokens)
  got, _ = forward(config, params, jnp.asarray(tokens, jnp.int32), init_cache(config, 2, 32))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("loaded", SCAN_FAMILIES, indirect=True)
def test_scanned_layers_match_per_layer(loaded):
  """`scan_layers`: per-layer windows and RoPE bases looked up by the traced layer index."""
  _, config, params = loaded
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, size=(2, 19)), jnp.int32)
  want, _ = forward(config, params, tokens, init_cache(config, 2, 24))
  for block in (0, 8):
    scanned = config.replace(scan_layers=True, attention_block=block)
    got, _ = forward(scanned, stack_layers(params, config.n_layers), tokens, init_cache(scanned, 2, 24))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_greedy_matches_transformers_generate(loaded):
  """Ragged prompts longer than the windows (6) and within the dynamic RoPE's original context (16),
  continued past it."""
  assert_greedy_matches_generate(*loaded, 14)


@pytest.mark.slow
@pytest.mark.parametrize("loaded", CACHE_FAMILIES, indirect=True)
def test_incremental_decoding_equals_full_forward(loaded):
  """Prefill 9 tokens, then feed 3, 1, 1 ... through the cache: same logits as one full pass."""
  _, config, params = loaded
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, size=(2, 16)), jnp.int32)
  full, _ = forward(config, params, tokens, init_cache(config, 2, 20))
  cache = init_cache(config, 2, 20)
  pieces = []
  for start, stop in [(0, 9), (9, 12), (12, 13), (13, 14), (14, 16)]:
    logits, cache = forward(config, params, tokens[:, start:stop], cache)
    cache = cache.advance(jnp.full((2,), stop - start))
    pieces.append(logits)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, 1)), np.asarray(full), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("loaded", CACHE_FAMILIES, indirect=True)
def test_ragged_rows_equal_rows_alone(loaded):
  """Rows at different cache offsets in one call give what each row gives alone."""
  _, config, params = loaded
  rng = np.random.default_rng(2)
  prefixes = [rng.integers(0, VOCAB, size=n) for n in (3, 11)]
  chunk = jnp.asarray(rng.integers(0, VOCAB, size=(2, 4)), jnp.int32)
  cache = init_cache(config, 2, 24)
  padded = np.zeros((2, 11), np.int32)
  for b, p in enumerate(prefixes):
    padded[b, :len(p)] = p
  _, cache = forward(config, params, jnp.asarray(padded), cache)
  cache = cache.advance(jnp.asarray([3, 11]))
  batched, _ = forward(config, params, chunk, cache)
  for b, p in enumerate(prefixes):
    alone = jnp.concatenate([jnp.asarray(p, jnp.int32)[None], chunk[b:b + 1]], axis=1)
    want, _ = forward(config, params, alone, init_cache(config, 1, 24))
    np.testing.assert_allclose(np.asarray(batched[b]), np.asarray(want[0, len(p):]), atol=1e-5)


def test_pytorch_bin_checkpoint_loads(tmp_path):
  hf_model = save_hf_model("qwen2", str(tmp_path), safe=False)
  config, params = load_hf_dir(str(tmp_path))
  tokens = np.arange(10)[None] % VOCAB
  with torch.no_grad():
    want = hf_model(torch.tensor(tokens)).logits.numpy()
  got, _ = forward(config, params, jnp.asarray(tokens, jnp.int32), init_cache(config, 1, 10))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def test_dynamic_rope_differs_from_one_long_transformers_call(tmp_path):
  """Where the dynamic NTK semantics part (documented in `models.rope`): one transformers call over 23 >
  16 positions rotates all of them with the frequencies of length 23; specjax each with its own. Up to
  the original context the two agree."""
  hf_model = save_hf_model("llama_dynamic", str(tmp_path))
  config, params = load_hf_dir(str(tmp_path))
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(1, 23))
  got, _ = forward(config, params, jnp.asarray(tokens, jnp.int32), init_cache(config, 1, 32))
  with torch.no_grad():  # the short call first: transformers keeps the longest length seen so far
    short_call = hf_model(torch.tensor(tokens[:, :16])).logits.numpy()
    long_call = hf_model(torch.tensor(tokens)).logits.numpy()
  assert np.abs(np.asarray(got) - long_call).max() > 1e-2
  np.testing.assert_allclose(np.asarray(got)[:, :16], short_call, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama3", "llama_linear", "llama_dynamic", "llama_yarn", "gemma3"])
def test_classic_rope_keys_read_like_rope_parameters(family, tmp_path):
  """A config.json in the pre-v5 style (`rope_scaling`, `rope_theta`, Gemma 3's `rope_local_base_freq`)
  gives the config its v5 `rope_parameters` give."""
  save_hf_model(family, str(tmp_path))
  v5 = json.loads((tmp_path / "config.json").read_text())
  classic = {k: v for k, v in v5.items() if k != "rope_parameters"}
  params = v5["rope_parameters"]
  if family == "gemma3":
    classic.update(rope_theta=params["full_attention"]["rope_theta"],
                   rope_local_base_freq=params["sliding_attention"]["rope_theta"],
                   rope_scaling={k: v for k, v in params["full_attention"].items() if k != "rope_theta"})
  else:
    classic.update(
        rope_theta=params["rope_theta"],
        rope_scaling={("type" if k == "rope_type" else k): v for k, v in params.items() if k != "rope_theta"})
  assert config_from_hf_dict(classic) == config_from_hf_dict(v5)
  assert config_from_hf_dict(v5).rope_scaling.type != "default"


def test_unknown_rope_type_is_named():
  hf = {
      "model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
      "intermediate_size": 8, "max_position_embeddings": 16, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}
  }
  with pytest.raises(ValueError, match="unsupported RoPE type 'longrope'"):
    config_from_hf_dict(hf)


def test_multimodal_gemma3_checkpoint_loads_its_language_model(tmp_path):
  """A `gemma3` (image-text) checkpoint: specjax reads its `text_config` and its language model's
  tensors (`model.language_model.*`), skips the vision tower, and gives the multimodal model's text logits."""
  text_model = save_hf_model("gemma3", str(tmp_path / "text"))
  vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                patch_size=14)
  config = transformers.Gemma3Config(text_config=text_model.config.to_dict(), vision_config=vision,
                                     mm_tokens_per_image=4)
  model = transformers.Gemma3ForConditionalGeneration(config).eval()
  model.model.language_model.load_state_dict(text_model.model.state_dict())
  model.save_pretrained(str(tmp_path / "multimodal"))
  ours_config, params = load_hf_dir(str(tmp_path / "multimodal"))
  assert ours_config == load_hf_dir(str(tmp_path / "text"))[0]
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(1, 15))
  with torch.no_grad():
    want = model(input_ids=torch.tensor(tokens)).logits.numpy()
  got, _ = forward(ours_config, params, jnp.asarray(tokens, jnp.int32), init_cache(ours_config, 1, 16))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
