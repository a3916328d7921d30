"""`sampling.probabilities` equals a float64 numpy reference written from the definitions (temperature,
then top-k, then top-p on the renormalized top-k distribution), also when the vocabulary exceeds the
`candidates` bound (top-k above it, a nucleus outside it: the full-sort fallback) and with many ties;
greedy is the argmax (one-hot in `probabilities`); `sample` draws from the distribution it is given;
the knobs' values are runtime arrays (one compiled program), the modes static flags.

Ties, as implemented and checked here: top-k keeps every token whose logit equals the k-th largest
(possibly more than k tokens); top-p keeps every token whose probability equals the smallest kept one;
greedy takes the first index among equal maxima (`jnp.argmax`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling
from specjax.sampling import Knobs, greedy_tokens, next_tokens, sample, sampling_params
from specjax.testing import reference
from tests.helpers.stats import chi_square_pvalue

probabilities = jax.jit(sampling.probabilities)  # one compile per shape and mode

# The float64 reference shared with the end-to-end exactness tests (`engine.exact_distribution`):
# checked here against the library, ties included.
_reference = reference.probabilities

SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=2.5),
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.8, top_k=5),
    dict(temperature=1.0, top_p=0.3),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.9, top_k=8, top_p=0.75)
]


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_probabilities_match_float64_reference(setting):
  logits_ZxV = np.random.default_rng(0).normal(0.0, 2.0, size=(64, 50)).astype(np.float32)
  got = np.asarray(probabilities(jnp.asarray(logits_ZxV), sampling_params(**setting)))
  assert got.dtype == np.float32
  want = np.stack([_reference(row, **setting) for row in logits_ZxV])
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


BOUNDED = [
    dict(temperature=1.0, top_k=3),
    dict(temperature=0.8, top_k=20),
    dict(temperature=1.0, top_k=700),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=2.5, top_p=0.95),
    dict(temperature=0.9, top_k=12, top_p=0.8),
    dict(temperature=3.0, top_k=600, top_p=0.9)
]


@pytest.mark.parametrize("quantized", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("setting", BOUNDED, ids=str)
def test_bounded_candidates_match_the_float64_reference(setting, quantized):
  """V = 600 > candidates = 16: top-k within and beyond the bound (k = 700 raises the bound past V),
  nuclei inside the candidates (peaked rows) and outside them (flat rows at T = 2.5 and 3: the
  full-sort fallback), both knobs combined. Quantized logits tie in large groups, at the k-th largest
  and at the nucleus' edge."""
  rng = np.random.default_rng(3)
  logits_ZxV = rng.normal(0.0, 3.0, size=(24, 600))
  if quantized:
    logits_ZxV = np.round(logits_ZxV)
  logits_ZxV = logits_ZxV.astype(np.float32)
  params = sampling_params(**setting, candidates=16)
  got = np.asarray(probabilities(jnp.asarray(logits_ZxV), params))
  want = np.stack([_reference(row, **setting) for row in logits_ZxV])
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  np.testing.assert_array_equal(got > 0, want > 0)


def test_nucleus_outside_the_candidates_falls_back_to_a_search_of_the_whole_vocabulary():
  """Rows whose 16 candidates hold less than top_p are exact too, with or without peaked rows in the
  same call (the fallback is per call); a 16-candidate nucleus alone would keep at most 16 tokens."""
  rng = np.random.default_rng(4)
  flat_V = rng.normal(0.0, 0.1, size=600).astype(np.float32)
  peaked_V = (10.0 * np.eye(600)[5]).astype(np.float32)
  for rows in ([flat_V], [flat_V, peaked_V], [peaked_V]):
    logits_ZxV = np.stack(rows)
    got = np.asarray(probabilities(jnp.asarray(logits_ZxV), sampling_params(1.0, top_p=0.9, candidates=16)))
    want = np.stack([_reference(row, 1.0, top_p=0.9) for row in logits_ZxV])
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  assert (got[0] > 0).sum() == 1 and (np.asarray(
      probabilities(jnp.asarray(flat_V[None]), sampling_params(1.0, top_p=0.9, candidates=16))) > 0).sum() > 400


def test_each_rows_knobs_give_that_rows_own_distribution():
  """Knobs of shape [B] (each request's own), logits [B, T, V]: each of row b's T positions gets exactly
  (bit for bit) what a call with row b's knobs for every row gives, in one program that filters: a greedy
  row (the one-hot argmax), a row with both filters off and one with top-k 0 (both unfiltered), one with
  both filters. V = 600 > candidates = 16, and the top-p rows are flat (T = 2.5: the nucleus fallback).
  The scalar calls reuse the bounded test's programs (same [24, V] shape and modes)."""
  rows = [Knobs(0.0, 12, 0.8), Knobs(0.7, 0, 1.0), Knobs(2.5, 0, 0.95), Knobs(3.0, 12, 0.9)]
  logits_BxTxV = np.random.default_rng(3).normal(0.0, 3.0, size=(4, 6, 600)).astype(np.float32)
  params = sampling_params(*zip(*rows), candidates=16)
  assert (params.greedy, params.use_top_k, params.use_top_p, params.temperature.shape) == (False, True, True, (4,))
  got_BxTxV = np.asarray(probabilities(jnp.asarray(logits_BxTxV), params))
  logits_ZxV = jnp.asarray(logits_BxTxV.reshape(24, 600))
  np.testing.assert_array_equal(got_BxTxV[0], np.eye(600, dtype=np.float32)[np.argmax(logits_BxTxV[0], -1)])
  for row, knobs in enumerate(rows[1:], 1):
    want_ZxV = np.asarray(probabilities(logits_ZxV, sampling_params(*knobs, candidates=16)))
    np.testing.assert_array_equal(got_BxTxV[row], want_ZxV.reshape(4, 6, 600)[row], err_msg=str(knobs))
  assert ((got_BxTxV[2] > 0).sum(-1) > 16).all()  # flat rows: the nucleus lies beyond the candidates


def test_knob_values_share_one_program_and_modes_are_static():
  """Changing temperature, top_k or top_p within a mode reuses the compiled program; greedy <-> sampled
  and top-k / top-p on <-> off are static flags (a new program); top_k above the default bound raises
  the static `candidates` to it."""
  traces = []

  @jax.jit
  def traced(logits_ZxV, params):
    traces.append(params)
    return sampling.probabilities(logits_ZxV, params)

  logits_ZxV = jnp.asarray(np.random.default_rng(5).normal(size=(2, 300)), jnp.float32)
  for settings in ([dict(temperature=1.0, top_k=40),
                    dict(temperature=0.7,
                         top_k=50)], [dict(temperature=1.0, top_p=0.9),
                                      dict(temperature=1.2, top_p=0.5)],
                   [dict(temperature=1.0, top_k=40, top_p=0.9),
                    dict(temperature=0.5, top_k=5, top_p=0.3)]):
    traces.clear()
    for setting in settings:
      traced(logits_ZxV, sampling_params(**setting))
    assert len(traces) == 1
  modes = [sampling_params(0.0), sampling_params(1.0), sampling_params(1.0, top_k=40), sampling_params(1.0, top_p=0.9)]
  assert [(p.greedy, p.use_top_k, p.use_top_p) for p in modes] == [(True, False, False), (False, False, False),
                                                                   (False, True, False), (False, False, True)]
  assert len({jax.tree.structure(p) for p in modes}) == 4
  assert sampling_params(1.0, top_k=40).candidates == sampling.CANDIDATES
  assert sampling_params(1.0, top_k=1000).candidates == 1000
  # Per-row knobs: greedy only when every row is, a filter on when any row uses it, the bound the largest k.
  mixed = sampling_params([0.0, 0.7], [0, 1000], [1.0, 0.9])
  assert (mixed.greedy, mixed.use_top_k, mixed.use_top_p, mixed.candidates) == (False, True, True, 1000)
  assert sampling_params([0.0, 0.0]).greedy and not sampling_params([0.7, 1.0], top_p=[1.0, 1.0]).use_top_p
  # A program serves rows within its mode; a row needing another one is refused.
  served = modes[2].for_rows([Knobs(0.0), Knobs(0.5, 3)])
  assert jax.tree.structure(served) == jax.tree.structure(modes[2]) and served.top_k.tolist() == [0, 3]
  with pytest.raises(ValueError, match="need another program"):
    modes[0].for_rows([Knobs(0.0), Knobs(0.5)])
  with pytest.raises(ValueError, match=r"temperature\[1\] must be >= 0"):
    sampling_params([0.5, -1.0])


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


def test_greedy_is_the_argmax_whatever_top_k_and_top_p():
  """`probabilities` gives the one-hot argmax, `greedy_tokens` and `next_tokens` the argmax itself (any
  key), the first of tied maxima included."""
  logits_ZxV = np.random.default_rng(2).normal(size=(16, 30)).astype(np.float32)
  logits_ZxV[0, [4, 9]] = logits_ZxV[0].max() + 1.0  # a tie: index 4 wins
  for top_k, top_p in [(0, 1.0), (3, 1.0), (0, 0.5), (2, 0.1)]:
    params = sampling_params(0.0, top_k=top_k, top_p=top_p)
    got = np.asarray(probabilities(logits_ZxV, params))
    np.testing.assert_array_equal(got, np.eye(30, dtype=np.float32)[np.argmax(logits_ZxV, -1)])
    for seed in range(3):
      np.testing.assert_array_equal(
          jax.jit(next_tokens)(jax.random.key(seed), logits_ZxV, params), np.argmax(logits_ZxV, -1))
  assert int(greedy_tokens(jnp.asarray(logits_ZxV))[0]) == 4
  logits_ZxV[1, [7, 3]] = np.nan  # like jnp.argmax: the first NaN
  np.testing.assert_array_equal(greedy_tokens(jnp.asarray(logits_ZxV)), jnp.argmax(logits_ZxV, -1))
  assert int(greedy_tokens(jnp.asarray(logits_ZxV))[1]) == 3
  np.testing.assert_array_equal(greedy_tokens(jnp.asarray(logits_ZxV, jnp.bfloat16)),
                                np.argmax(np.float32(jnp.asarray(logits_ZxV, jnp.bfloat16)), -1))


def test_sample_draws_from_the_given_distribution():
  """A point mass returns its token for every key (drawn like any distribution: log 0 = -inf);
  otherwise a chi-square test at level 0.001 on N = 100,000 draws."""
  point_ZxV = jnp.asarray(np.eye(7, dtype=np.float32)[[3, 0, 6]])
  mixed_ZxV = jnp.asarray([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])  # one row is not a point mass
  for seed in range(5):
    np.testing.assert_array_equal(sample(jax.random.key(seed), point_ZxV), [3, 0, 6])
    first, second = np.asarray(sample(jax.random.key(seed), mixed_ZxV))
    assert first == 1 and second in (0, 2)
  probs_V = np.array([0.05, 0.3, 0.0, 0.15, 0.4, 0.1], np.float32)
  draws = np.asarray(sample(jax.random.key(0), jnp.broadcast_to(probs_V, (100_000, 6))))
  assert chi_square_pvalue(np.bincount(draws, minlength=6), np.float64(probs_V)) > 1e-3


def test_nucleus_edge_search_equals_the_sorted_threshold_bit_for_bit():
  """The sort-free search over the whole vocabulary (the fallback; it never gathers a vocabulary split
  over a mesh) finds exactly the smallest kept probability that the sorted cumulative mass gives,
  for 200 rows of flat and peaked distributions and nucleus sizes from 0.05 to 0.99."""
  rng = np.random.default_rng(8)
  logits_ZxV = rng.normal(0.0, rng.uniform(0.1, 4.0, size=(200, 1)), size=(200, 600))
  probs_ZxV = jax.nn.softmax(jnp.asarray(logits_ZxV, jnp.float32), axis=-1)
  for p in (0.05, 0.5, 0.9, 0.99):
    want_Zx1, _ = sampling._nucleus_threshold(-jnp.sort(-probs_ZxV, axis=-1), jnp.float32(p))
    got_Zx1 = sampling._nucleus_threshold_by_search(probs_ZxV, jnp.float32(p))
    np.testing.assert_array_equal(np.asarray(got_Zx1), np.asarray(want_Zx1))
