"""Acceptance statistics: `record` counts what each live row accepted, `summarize` derives the rates
exactly, the theory's formulas hold at their edges, and on a simulated i.i.d. acceptance process the
estimates recover alpha and the expected accepted length."""

import jax
import numpy as np
import pytest

from specjax import metrics


def _recorded(num_accepted_RdxB, live_RdxB, k, num_proposed_RdxB=None, forced_RdxB=None):
  counts = metrics.zero_counts(num_accepted_RdxB.shape[1], k)
  record = jax.jit(metrics.record)
  if num_proposed_RdxB is None:
    num_proposed_RdxB = np.full(num_accepted_RdxB.shape, k)
  if forced_RdxB is None:
    forced_RdxB = np.zeros(num_accepted_RdxB.shape, np.int32)
  for num_accepted_B, num_proposed_B, live_B, forced_B in zip(num_accepted_RdxB, num_proposed_RdxB, live_RdxB,
                                                              forced_RdxB):
    counts = record(counts, np.asarray(num_accepted_B, np.int32), np.asarray(num_proposed_B, np.int32),
                    np.asarray(live_B), np.asarray(forced_B, np.int32))
  return counts


def test_record_and_summarize_by_hand():
  # Row 0: rounds accepting 3, 0, 1 of K = 3; row 1: 2, then 3 in a round where it was already done.
  # Forced tokens: row 0 1 + 0 + 2; row 1 none while live (the 2 and 1 of its done rounds are not counted).
  counts = _recorded(np.array([[3, 2], [0, 3], [1, 3]]), np.array([[1, 1], [1, 0], [1, 0]], bool), k=3,
                     forced_RdxB=np.array([[1, 0], [0, 2], [2, 1]]))
  np.testing.assert_array_equal(counts.rounds, [3, 1])
  np.testing.assert_array_equal(counts.accepted, [4, 2])
  np.testing.assert_array_equal(counts.accepted_at, [[2, 1, 1], [1, 1, 0]])
  summary = metrics.summarize(counts)
  assert summary["per_row"][0] == {
      "rounds": 3, "proposed": 9, "accepted": 4, "rejections": 2, "acceptance_rate": 4 / 9, "alpha_hat": 4 / 6,
      "mean_accepted_length": 7 / 3, "accepted_at_position": [2, 1, 1], "reached_at_position": [3, 2, 1],
      "position_acceptance_rate": [2 / 3, 1 / 2, 1.0], "jump_forward": 3
  }
  total = summary["total"]
  assert (total["rounds"], total["proposed"], total["accepted"], total["rejections"]) == (4, 12, 6, 3)
  assert total["alpha_hat"] == 6 / 9 and total["mean_accepted_length"] == 10 / 4
  assert total["reached_at_position"] == [4, 3, 2] and total["jump_forward"] == 3


def test_rounds_that_propose_fewer_than_k_tokens():
  """Row 0 proposes 2 of K = 3 and accepts both (no rejection: the bonus follows), then proposes 0
  (nothing to check: no rejection either), then 3 and accepts 1; row 1 proposes 1 and rejects it."""
  counts = _recorded(np.array([[2, 0], [0, 0], [1, 0]]), np.ones((3, 2), bool), k=3, num_proposed_RdxB=np.array([[2, 1],
                                                                                                                 [0, 1],
                                                                                                                 [3,
                                                                                                                  1]]))
  row0, row1 = metrics.summarize(counts)["per_row"]
  assert (row0["proposed"], row0["accepted"], row0["rejections"]) == (5, 3, 1)
  assert row0["reached_at_position"] == [2, 2, 0] and row0["accepted_at_position"] == [2, 1, 0]
  assert row0["acceptance_rate"] == 3 / 5 and row0["alpha_hat"] == 3 / 4
  assert row0["mean_accepted_length"] == 6 / 3
  assert (row1["proposed"], row1["accepted"], row1["rejections"]) == (3, 0, 3)
  assert row1["position_acceptance_rate"] == [0.0, None, None]


def test_rows_without_rounds_have_undefined_rates():
  summary = metrics.summarize(metrics.zero_counts(2, 4))
  assert summary["total"]["acceptance_rate"] is None and summary["total"]["alpha_hat"] is None
  assert summary["per_row"][1]["position_acceptance_rate"] == [None] * 4


def test_theory_formulas():
  k, c = 4, 0.1
  assert metrics.expected_accepted_length(0.0, k) == 1.0
  assert metrics.expected_accepted_length(1.0, k) == k + 1
  alpha = 0.8
  closed_form = (1 - alpha**(k + 1)) / (1 - alpha)
  assert metrics.expected_accepted_length(alpha, k) == pytest.approx(closed_form, rel=1e-12)
  assert metrics.theoretical_speedup(alpha, k, c) == pytest.approx(closed_form / (k * c + 1), rel=1e-12)
  assert metrics.theoretical_speedup(1.0, k, c) == (k + 1) / (k * c + 1)
  assert metrics.theoretical_speedup(alpha, k, c, verify_cost=1.8) == pytest.approx(closed_form / (k * c + 1.8),
                                                                                    rel=1e-12)
  assert metrics.theoretical_speedup(1 - 1e-9, k, c) == pytest.approx((k + 1) / (k * c + 1), rel=1e-8)
  assert metrics.theoretical_speedup(0.0, k, c) == 1 / (k * c + 1)  # every round still emits a token
  for bad in [dict(alpha=1.5), dict(alpha=-0.1), dict(k=0), dict(k=2.5), dict(c=-1.0)]:
    with pytest.raises(ValueError):
      metrics.theoretical_speedup(**(dict(alpha=0.5, k=3, c=0.1) | bad))


def test_estimates_recover_alpha_on_a_simulated_iid_process():
  """20,000 rounds (1,000 rows x 20), each position accepted independently with alpha = 0.7, K = 4:
  alpha_hat and the mean accepted length match the theory within 4 standard errors."""
  rng, alpha, k = np.random.default_rng(0), 0.7, 4
  accepted_RdxBxK = rng.random((20, 1000, k)) < alpha
  num_accepted_RdxB = np.cumprod(accepted_RdxBxK, axis=-1).sum(-1)
  total = metrics.summarize(_recorded(num_accepted_RdxB, np.ones_like(num_accepted_RdxB, bool), k))["total"]
  trials = total["accepted"] + total["rejections"]
  assert abs(total["alpha_hat"] - alpha) < 4 * np.sqrt(alpha * (1 - alpha) / trials)
  lengths = num_accepted_RdxB + 1
  assert abs(total["mean_accepted_length"] - metrics.expected_accepted_length(alpha, k)) < \
      4 * lengths.std() / np.sqrt(lengths.size)
  np.testing.assert_allclose(total["position_acceptance_rate"], alpha, atol=0.02)
