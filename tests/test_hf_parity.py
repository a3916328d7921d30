"""Logits of HF checkpoints loaded by specjax equal `transformers` (float32, max abs err <= 1e-4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.models.hf import load_hf_dir
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import forward
from tests.tiny_hf import FAMILIES, VOCAB, save_hf_model


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, tmp_path_factory):
  directory = str(tmp_path_factory.mktemp(request.param))
  hf_model = save_hf_model(request.param, directory)
  config, params = load_hf_dir(directory)
  return hf_model, config, params


def test_full_forward_matches_transformers(loaded):
  hf_model, config, params = loaded
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 23))
  with torch.no_grad():
    want = hf_model(torch.tensor(tokens)).logits.numpy()
  got, _ = forward(config, params, jnp.asarray(tokens, jnp.int32), init_cache(config, 2, 32))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


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
