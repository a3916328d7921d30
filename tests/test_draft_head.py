"""The frequency-ranked draft head: its logits equal the full head's on the subset and give the other
tokens probability 0; the vocabulary is the most frequent tokens of a corpus, stop tokens included."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_cache
from specjax.models.tokenizer import Tokenizer
from specjax.models.transformer import forward, forward_hidden, init_params
from specjax.sampling import probabilities, sampling_params
from specjax.draft_vocab import corpus_token_counts, most_frequent, token_counts
from specjax.speculative.drafters.draft_head import restrict_head
from tests.helpers.tiny_hf import save_char_tokenizer


@pytest.mark.parametrize("tied, arch, final_softcap", [(False, "llama", 0.0), (True, "llama", 0.0),
                                                       (True, "gemma", 0.05)])  # Gemma 2: capped logits
def test_restricted_logits_equal_the_full_head_on_the_subset(tied, arch, final_softcap):
  config = ModelConfig(arch=arch, vocab_size=50, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                       tie_embeddings=tied, final_softcap=final_softcap)
  params = init_params(config, jax.random.key(0))
  tokens_1x4 = jnp.asarray([[3, 9, 27, 1]], jnp.int32)
  full_1x4xV, _ = forward(config, params, tokens_1x4, init_cache(config, 1, 8))
  hidden_1x4xD, _ = forward_hidden(config, params, tokens_1x4, init_cache(config, 1, 8))
  subset = [0, 7, 7, 49, 12]  # duplicates are dropped
  restricted_1x4xV = restrict_head(config, params, subset).logits(hidden_1x4xD)
  np.testing.assert_allclose(restricted_1x4xV[..., [0, 7, 12, 49]], full_1x4xV[..., [0, 7, 12, 49]], rtol=1e-6,
                             atol=1e-6)
  outside = np.setdiff1d(np.arange(50), subset)
  assert np.all(np.isneginf(restricted_1x4xV[..., outside]))
  for sampling in (sampling_params(0.0), sampling_params(0.7, top_k=3), sampling_params(1.0, top_p=0.8)):
    probs_1x4xV = np.asarray(probabilities(restricted_1x4xV, sampling))
    assert np.all(probs_1x4xV[..., outside] == 0.0)
    np.testing.assert_allclose(probs_1x4xV.sum(-1), 1.0, rtol=1e-5)


def test_restrict_head_rejects_bad_ids():
  config = ModelConfig(arch="llama", vocab_size=10, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=16)
  params = init_params(config, jax.random.key(0))
  with pytest.raises(ValueError, match=r"must be in \[0, 10\)"):
    restrict_head(config, params, [3, 10])
  with pytest.raises(ValueError, match="at least one token"):
    restrict_head(config, params, [])


def test_most_frequent_ranks_by_count_then_id_and_keeps_required_tokens():
  counts = np.array([5, 0, 9, 5, 1, 9, 0, 2])
  np.testing.assert_array_equal(most_frequent(counts, 3), [0, 2, 5])  # 9, 9, then 5 at the smaller id
  np.testing.assert_array_equal(most_frequent(counts, 3, always=[6]), [2, 5, 6])
  np.testing.assert_array_equal(most_frequent(counts, 8), np.arange(8))
  with pytest.raises(ValueError, match=r"must be in \[1, 8\]"):
    most_frequent(counts, 9)
  with pytest.raises(ValueError, match="cannot hold the 2 required tokens"):
    most_frequent(counts, 1, always=[1, 6])


def test_token_counts_equal_a_counter():
  texts = ["abcab", "", "zz"]
  encode = lambda text: [ord(c) - ord("a") for c in text]
  expected = collections.Counter(t for text in texts for t in encode(text))
  counts = token_counts(encode, texts, 26)
  assert {i: int(c) for i, c in enumerate(counts) if c} == dict(expected)
  with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
    token_counts(encode, ["d"], 3)


def test_corpus_counts_are_cached_per_tokenizer_and_source(tmp_path):
  (tmp_path / "tok").mkdir()
  save_char_tokenizer(str(tmp_path / "tok"))
  tokenizer = Tokenizer.from_hf_dir(str(tmp_path / "tok"))
  (tmp_path / "src").mkdir()
  (tmp_path / "src" / "a.py").write_text("aab\n")
  source, cache = str(tmp_path / "src"), str(tmp_path / "cache")
  counts = corpus_token_counts(tokenizer, source, 100, cache)
  assert counts.shape == (100,) and counts.sum() == len(tokenizer.encode("aab\n", add_special_tokens=False))
  (tmp_path / "src" / "a.py").write_text("bbbbbbbb\n")  # a cache hit does not reread the corpus
  np.testing.assert_array_equal(corpus_token_counts(tokenizer, source, 100, cache), counts)
  assert corpus_token_counts(tokenizer, source, 101, cache).shape == (101,)  # another key
