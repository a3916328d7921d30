"""`sampling.probabilities` equals a float64 numpy reference written from the definitions (temperature,
then top-k, then top-p on the renormalized top-k distribution); greedy is the one-hot argmax; `sample`
draws from the distribution it is given.

Ties, as implemented and checked here: top-k keeps every token whose logit equals the k-th largest
(possibly more than k tokens); top-p keeps every token whose probability equals the smallest kept one;
greedy takes the first index among equal maxima (`jnp.argmax`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling
from specjax.sampling import sample, sampling_params
from tests.test_acceptance import chi_square_pvalue

probabilities = jax.jit(sampling.probabilities)  # one compile per shape; eager calls recompile the conds


def _reference(logits, temperature, top_k=0, top_p=1.0):
  """Float64 probabilities for one row of logits."""
  logits = np.float64(logits)
  if temperature == 0:
    return np.eye(logits.size)[np.argmax(logits)]
  scaled = logits / temperature
  if top_k:
    kth_largest = np.sort(scaled)[::-1][min(top_k, logits.size) - 1]  # k >= V keeps everything
    scaled = np.where(scaled >= kth_largest, scaled, -np.inf)
  probs = np.exp(scaled - scaled.max())
  probs /= probs.sum()
  if top_p < 1.0:
    descending = np.sort(probs)[::-1]
    size = np.argmax(np.cumsum(descending) >= top_p) + 1  # smallest prefix with mass >= top_p
    probs = np.where(probs >= descending[size - 1], probs, 0.0)
    probs /= probs.sum()
  return probs


SETTINGS = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=2.5),
            dict(temperature=1.0, top_k=1), dict(temperature=0.8, top_k=5),
            dict(temperature=1.0, top_p=0.3), dict(temperature=1.3, top_p=0.9),
            dict(temperature=0.9, top_k=8, top_p=0.75)]


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_probabilities_match_float64_reference(setting):
  logits_NxV = np.random.default_rng(0).normal(0.0, 2.0, size=(64, 50)).astype(np.float32)
  got = np.asarray(probabilities(jnp.asarray(logits_NxV), sampling_params(**setting)))
  assert got.dtype == np.float32
  want = np.stack([_reference(row, **setting) for row in logits_NxV])
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_shape_is_kept_for_any_leading_axes():
  logits_BxTxV = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 11)), jnp.float32)
  got = probabilities(logits_BxTxV, sampling_params(1.0, top_k=4))
  assert got.shape == (2, 3, 11)
  np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-6)
  assert ((got > 0).sum(-1) == 4).all()


def test_ties():
  logits = jnp.asarray([[3.0, 1.0, 1.0, 1.0, 0.0], [0.0, 2.0, 2.0, 1.0, 1.0]])
  top2 = np.asarray(probabilities(logits, sampling_params(1.0, top_k=2)))
  np.testing.assert_array_equal(top2 > 0, [[1, 1, 1, 1, 0], [0, 1, 1, 0, 0]])  # all tied at the 2nd kept
  # Row 0: the top token holds 0.687 < 0.75 and one more (0.093) reaches 0.78, but it ties with two
  # others: all three are kept.
  nucleus = np.asarray(probabilities(logits, sampling_params(1.0, top_p=0.75)))
  np.testing.assert_array_equal(nucleus[0] > 0, [1, 1, 1, 1, 0])
  greedy = np.asarray(probabilities(logits, sampling_params(0.0)))
  np.testing.assert_array_equal(np.argmax(greedy, -1), [0, 1])  # the first of tied maxima
  for setting in SETTINGS:
    for row in range(2):
      np.testing.assert_allclose(
          np.asarray(probabilities(logits, sampling_params(**setting)))[row],
          _reference(np.asarray(logits)[row], **setting), atol=1e-6)


def test_greedy_is_one_hot_argmax_whatever_top_k_and_top_p():
  logits_NxV = np.random.default_rng(2).normal(size=(16, 30)).astype(np.float32)
  for top_k, top_p in [(0, 1.0), (3, 1.0), (0, 0.5), (2, 0.1)]:
    got = np.asarray(probabilities(logits_NxV, sampling_params(0.0, top_k=top_k, top_p=top_p)))
    np.testing.assert_array_equal(got, np.eye(30, dtype=np.float32)[np.argmax(logits_NxV, -1)])


def test_sample_draws_from_the_given_distribution():
  """A point mass returns its token for every key; otherwise a chi-square test at level 0.001 on
  N = 100,000 draws."""
  point_NxV = jnp.asarray(np.eye(7, dtype=np.float32)[[3, 0, 6]])
  mixed_NxV = jnp.asarray([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])  # one row is not a point mass: Gumbel path
  for seed in range(5):
    np.testing.assert_array_equal(sample(jax.random.key(seed), point_NxV), [3, 0, 6])
    first, second = np.asarray(sample(jax.random.key(seed), mixed_NxV))
    assert first == 1 and second in (0, 2)
  probs_V = np.array([0.05, 0.3, 0.0, 0.15, 0.4, 0.1], np.float32)
  draws = np.asarray(sample(jax.random.key(0), jnp.broadcast_to(probs_V, (100_000, 6))))
  assert chi_square_pvalue(np.bincount(draws, minlength=6), np.float64(probs_V)) > 1e-3
