"""Divergences against a float64 numpy reference, zero for identical distributions, masking."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.distill import losses


def _reference(name, teacher, student, temperature, beta):
  """float64 numpy: q = softmax(teacher / T), p = softmax(student / T)."""
  def softmax(x):
    x = x.astype(np.float64) / temperature
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  q, p = softmax(teacher), softmax(student)
  kl = lambda a, b: np.sum(a * (np.log(a) - np.log(b)), -1)
  if name == "forward_kl":
    return kl(q, p)
  if name == "reverse_kl":
    return kl(p, q)
  if name == "jsd":
    m = beta * q + (1 - beta) * p
    return beta * kl(q, m) + (1 - beta) * kl(p, m)
  return 0.5 * np.abs(q - p).sum(-1)


def _logits(seed, shape, scale=3.0):
  return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


@pytest.mark.parametrize("name", losses.DIVERGENCES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_divergence_matches_float64_reference(name, temperature):
  teacher, student = _logits(0, (3, 5, 61)), _logits(1, (3, 5, 61))
  beta = 0.3
  got = losses.token_divergence(name, jnp.asarray(teacher), jnp.asarray(student), temperature, beta)
  want = _reference(name, teacher, student, temperature, beta)
  assert got.shape == (3, 5) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", losses.DIVERGENCES)
def test_divergence_is_zero_for_identical_distributions(name):
  logits = jnp.asarray(_logits(2, (4, 97), scale=8.0))
  shifted = logits + 5.0  # same distribution: softmax is shift-invariant
  np.testing.assert_allclose(np.asarray(losses.token_divergence(name, logits, shifted)), 0.0, atol=1e-5)


@pytest.mark.parametrize("name", losses.DIVERGENCES)
def test_divergence_is_finite_for_extreme_logits(name):
  teacher = jnp.asarray(_logits(3, (2, 40), scale=300.0))  # probabilities underflow to exactly 0
  student = jnp.asarray(_logits(4, (2, 40), scale=300.0))
  value = np.asarray(losses.token_divergence(name, teacher, student))
  assert np.all(np.isfinite(value)) and np.all(value >= 0)


def test_acceptance_is_one_minus_tvd_and_agreement_compares_argmax():
  teacher, student = jnp.asarray(_logits(5, (6, 33))), jnp.asarray(_logits(6, (6, 33)))
  np.testing.assert_allclose(np.asarray(losses.expected_acceptance(teacher, student, 1.3)),
                             1 - np.asarray(losses.token_divergence("tvd", teacher, student, 1.3)), atol=1e-6)
  want = (np.argmax(teacher, -1) == np.argmax(student, -1)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(losses.greedy_agreement(teacher, student)), want)


def test_masked_mean_ignores_masked_positions():
  values = jnp.asarray([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
  mask = jnp.asarray([[1, 1, 0], [1, 0, 1]])
  assert float(losses.masked_mean(values, mask)) == pytest.approx(2.5)
  assert float(losses.masked_mean(values, jnp.zeros_like(mask))) == 0.0


@pytest.mark.parametrize("name,beta", [("hellinger", 0.5), ("jsd", 0.0), ("jsd", 1.0)])
def test_bad_divergence_is_a_clear_error(name, beta):
  with pytest.raises(ValueError, match="divergence|beta"):
    losses.check_divergence(name, beta)
