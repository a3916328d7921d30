"""The acceptance rule alone: its output distribution equals the target's q exactly (by enumeration, for
random, equal, disjoint and sparse p and q), the jitted `verify` matches that by Monte Carlo at every
draft position, and greedy (one-hot) inputs give the target's argmax deterministically, which is what
`verify_greedy` computes from token ids."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.speculative import acceptance, proposal

V = 10
ALPHA = 1e-3  # significance level of every chi-square test below


def _dirichlet(rng, size=V, zeros=0):
  probs = rng.dirichlet(np.ones(size))
  probs[rng.choice(size, zeros, replace=False)] = 0.0
  return probs / probs.sum()


def _pairs():
  rng = np.random.default_rng(0)
  pairs = {f"random{i}": (_dirichlet(rng), _dirichlet(rng)) for i in range(3)}
  pairs["sparse"] = (_dirichlet(rng, zeros=4), _dirichlet(rng, zeros=5))
  same = _dirichlet(rng)
  pairs["equal"] = (same, same)
  pairs["nearly_equal"] = (same, same * (1 + 1e-7 * rng.standard_normal(V)))
  disjoint_p, disjoint_q = np.zeros(V), np.zeros(V)
  disjoint_p[:4], disjoint_q[4:] = _dirichlet(rng, 4), _dirichlet(rng, 6)
  pairs["disjoint"] = (disjoint_p, disjoint_q)
  pairs["point_draft"] = (np.eye(V)[3], _dirichlet(rng))
  pairs["point_target"] = (_dirichlet(rng), np.eye(V)[7])
  return {name: (p.astype(np.float32), (q / q.sum()).astype(np.float32))
          for name, (p, q) in pairs.items()}


PAIRS = _pairs()


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_single_step_output_distribution_is_exactly_q(name):
  """P(out = x) = p(x) min(1, q(x)/p(x)) + P(reject) residual(x), enumerated over the draft token."""
  p, q = (np.float64(a) for a in PAIRS[name])
  accept_prob = np.divide(q, p, out=np.zeros(V), where=p > 0).clip(max=1.0)  # P(u p(d) < q(d))
  accepted_mass = p * accept_prob
  residual = np.float64(acceptance.residual(jnp.asarray(PAIRS[name][1]), jnp.asarray(PAIRS[name][0])))
  np.testing.assert_allclose(residual.sum(), 1.0, atol=1e-6)
  output = accepted_mass + (1.0 - accepted_mass.sum()) * residual
  np.testing.assert_allclose(output, q, atol=1e-6)


def test_residual_falls_back_to_q_when_nothing_is_left():
  q = jnp.asarray(PAIRS["equal"][1])
  np.testing.assert_array_equal(acceptance.residual(q, q), q)
  assert not np.isnan(np.asarray(acceptance.residual(q, q))).any()


def chi_square_pvalue(observed, probs):
  """Chi-square goodness of fit of counts to `probs` on its support, cells expecting fewer than 5
  draws pooled; any draw outside the support gives p-value 0. (Also used by test_speculative.)"""
  support = probs > 0
  if observed[~support].any():
    return 0.0
  observed, expected = observed[support], probs[support] / probs[support].sum() * observed.sum()
  small = expected < 5
  if small.any():
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
  return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("name", ["random0", "sparse", "disjoint", "point_draft"])
def test_verify_matches_q_at_every_position_by_monte_carlo(name):
  """K = 2, position-independent p_i and q_i; N = 200,000 rows with drafts drawn from p. Position i is
  accepted in a fraction sum_x min(p_i(x), q_i(x)) of the rows that reach it (binomial test), and
  emitted token i + 1, present when n >= i, is distributed as q_{i+1} (the bonus token at i = 2)."""
  rng = np.random.default_rng(1)
  base_p, base_q = PAIRS[name]
  probs = [(base_p, base_q), (_dirichlet(rng).astype(np.float32), base_q[::-1].copy())]
  bonus_q = _dirichlet(rng).astype(np.float32)
  n_rows, k = 200_000, 2
  draft_probs_KxV = np.stack([p for p, _ in probs])
  target_probs_K1xV = np.concatenate([np.stack([q for _, q in probs]), bonus_q[None]])
  draft_BxK = np.stack([rng.choice(V, n_rows, p=np.float64(p) / np.float64(p).sum())
                        for p, _ in probs], axis=1)
  num_accepted, next_token = jax.jit(acceptance.verify)(
      jax.random.key(2), proposal.full(jnp.asarray(draft_BxK, jnp.int32),
                                       jnp.broadcast_to(draft_probs_KxV, (n_rows, k, V))),
      jnp.broadcast_to(target_probs_K1xV, (n_rows, k + 1, V)))
  num_accepted, next_token = np.asarray(num_accepted), np.asarray(next_token)
  for i, (p, q) in enumerate(probs):
    reached, accepted = (num_accepted >= i).sum(), (num_accepted > i).sum()
    assert reached or i > 0
    if reached:  # position 2 is never reached with disjoint supports (position 1 accepts with rate 0)
      assert stats.binomtest(accepted, reached, np.minimum(p, q).sum().clip(max=1.0)).pvalue > ALPHA
  emitted_BxK1 = np.where(np.arange(k + 1) < num_accepted[:, None], np.pad(draft_BxK, ((0, 0), (0, 1))),
                          next_token[:, None])
  for i in range(k + 1):
    rows = num_accepted >= i
    if rows.any():
      observed = np.bincount(emitted_BxK1[rows, i], minlength=V)
      assert chi_square_pvalue(observed, np.float64(target_probs_K1xV[i])) > ALPHA


def test_greedy_one_hot_inputs_give_the_target_argmax():
  """At temperature 0 both distributions are one-hot: accept while the draft equals the target's
  argmax, then emit the target's argmax, for every key."""
  target_BxK1 = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]])
  draft_BxK = np.array([[1, 2, 3], [1, 9, 3], [0, 2, 3], [5, 5, 5]])
  one_hot = lambda t: jnp.asarray(np.eye(V, dtype=np.float32)[t])
  verify = jax.jit(acceptance.verify)
  for seed in range(5):
    num_accepted, next_token = verify(jax.random.key(seed),
                                      proposal.full(jnp.asarray(draft_BxK, jnp.int32), one_hot(draft_BxK)),
                                      one_hot(target_BxK1))
    np.testing.assert_array_equal(num_accepted, [3, 1, 0, 3])
    np.testing.assert_array_equal(next_token, [4, 2, 1, 5])


def test_point_masses_and_short_proposals_emit_q_at_every_position():
  """Point-mass proposals (no [B, K, V] tensor) with per-row lengths 0, 1 or 2 of K = 2: each emitted
  token i, over the N = 150,000 rows that reach it, follows q_i (chi-square at level 0.001), where the
  token after a row's last proposed one is its bonus, drawn from the q at that position; a rejected
  point mass x is never resampled (the residual is q without x); slots past a row's length are never
  accepted."""
  rng = np.random.default_rng(3)
  n_rows, k = 150_000, 2
  target_probs_K1xV = np.stack([_dirichlet(rng) for _ in range(k + 1)]).astype(np.float32)
  draft_BxK = rng.integers(0, V, (n_rows, k)).astype(np.int32)  # any deterministic rule would do
  lengths_B = rng.integers(0, k + 1, n_rows).astype(np.int32)
  num_accepted, next_token = jax.jit(acceptance.verify)(
      jax.random.key(4), proposal.Proposal(tokens=jnp.asarray(draft_BxK), lengths=jnp.asarray(lengths_B)),
      jnp.broadcast_to(target_probs_K1xV, (n_rows, k + 1, V)))
  num_accepted, next_token = np.asarray(num_accepted), np.asarray(next_token)
  assert (num_accepted <= lengths_B).all()
  rejected = num_accepted < lengths_B
  assert not (next_token[rejected] == draft_BxK[rejected, num_accepted[rejected]]).any()
  emitted_BxK1 = np.where(np.arange(k + 1) < num_accepted[:, None], np.pad(draft_BxK, ((0, 0), (0, 1))),
                          next_token[:, None])
  for i in range(k + 1):
    rows = num_accepted >= i
    observed = np.bincount(emitted_BxK1[rows, i], minlength=V)
    assert chi_square_pvalue(observed, np.float64(target_probs_K1xV[i])) > ALPHA
  # The bonus after a full acceptance of a 1-token proposal comes from q_2, not q_3 or the residual.
  bonus_rows = (lengths_B == 1) & (num_accepted == 1)
  assert bonus_rows.sum() > 1000
  assert chi_square_pvalue(np.bincount(next_token[bonus_rows], minlength=V),
                           np.float64(target_probs_K1xV[1])) > ALPHA


@pytest.mark.parametrize("k", [1, 4])
def test_verify_greedy_on_ids_equals_verify_on_one_hot_distributions(k):
  """On 2,000 random rows (draft tokens agreeing with the target's argmax at random, per-row proposal
  lengths 0..K): `verify_greedy` on token ids gives exactly what `verify` gives on one-hot p and q, for
  one-hot and point-mass proposals and any key."""
  rng = np.random.default_rng(5)
  rows, vocab = 2_000, 7
  target_BxK1 = rng.integers(0, vocab, (rows, k + 1)).astype(np.int32)
  agree_BxK = rng.random((rows, k)) < 0.7
  draft_BxK = np.where(agree_BxK, target_BxK1[:, :k], rng.integers(0, vocab, (rows, k))).astype(np.int32)
  lengths_B = rng.integers(0, k + 1, rows).astype(np.int32)
  one_hot = lambda t: jnp.asarray(np.eye(vocab, dtype=np.float32)[t])
  tokens, lengths = jnp.asarray(draft_BxK), jnp.asarray(lengths_B)
  greedy = jax.jit(acceptance.verify_greedy)(proposal.Proposal(tokens=tokens, lengths=lengths),
                                             jnp.asarray(target_BxK1))
  assert 0 < int((greedy[0] > 0).sum()) < rows and int((greedy[0] == lengths_B).sum()) > 100
  for seed in range(3):
    for probs in (one_hot(draft_BxK), None):
      want = jax.jit(acceptance.verify)(jax.random.key(seed),
                                        proposal.Proposal(tokens=tokens, lengths=lengths, probs=probs),
                                        one_hot(target_BxK1))
      np.testing.assert_array_equal(greedy[0], want[0])
      np.testing.assert_array_equal(greedy[1], want[1])
