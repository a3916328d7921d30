"""The acceptance rule alone: its output distribution equals the target's q exactly (by enumeration, for
random, equal, disjoint and sparse p and q), the jitted `verify` matches that by Monte Carlo at every
draft position, and greedy (one-hot) inputs give the target's argmax deterministically, which is what
`verify_greedy` computes from token ids."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.speculative import acceptance, proposal
from tests.helpers import mutants
from tests.helpers.stats import chi_square_pvalue

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
  return {name: (p.astype(np.float32), (q / q.sum()).astype(np.float32)) for name, (p, q) in pairs.items()}


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
  draft_BxK = np.stack([rng.choice(V, n_rows, p=np.float64(p) / np.float64(p).sum()) for p, _ in probs], axis=1)
  num_accepted, next_token = jax.jit(acceptance.verify)(jax.random.key(2),
                                                        proposal.full(jnp.asarray(draft_BxK, jnp.int32),
                                                                      jnp.broadcast_to(draft_probs_KxV,
                                                                                       (n_rows, k, V))),
                                                        jnp.broadcast_to(target_probs_K1xV, (n_rows, k + 1, V)))
  num_accepted, next_token = np.asarray(num_accepted), np.asarray(next_token)
  for i, (p, q) in enumerate(probs):
    reached, accepted = (num_accepted >= i).sum(), (num_accepted > i).sum()
    assert reached or i > 0
    if reached:  # position 2 is never reached with disjoint supports (position 1 accepts with rate 0)
      assert stats.binomtest(accepted, reached, np.minimum(p, q).sum().clip(max=1.0)).pvalue > ALPHA
  emitted_BxK1 = np.where(
      np.arange(k + 1) < num_accepted[:, None], np.pad(draft_BxK, ((0, 0), (0, 1))), next_token[:, None])
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
  num_accepted, next_token = jax.jit(acceptance.verify)(jax.random.key(4),
                                                        proposal.Proposal(tokens=jnp.asarray(draft_BxK),
                                                                          lengths=jnp.asarray(lengths_B)),
                                                        jnp.broadcast_to(target_probs_K1xV, (n_rows, k + 1, V)))
  num_accepted, next_token = np.asarray(num_accepted), np.asarray(next_token)
  assert (num_accepted <= lengths_B).all()
  rejected = num_accepted < lengths_B
  assert not (next_token[rejected] == draft_BxK[rejected, num_accepted[rejected]]).any()
  emitted_BxK1 = np.where(
      np.arange(k + 1) < num_accepted[:, None], np.pad(draft_BxK, ((0, 0), (0, 1))), next_token[:, None])
  for i in range(k + 1):
    rows = num_accepted >= i
    observed = np.bincount(emitted_BxK1[rows, i], minlength=V)
    assert chi_square_pvalue(observed, np.float64(target_probs_K1xV[i])) > ALPHA
  # The bonus after a full acceptance of a 1-token proposal comes from q_2, not q_3 or the residual.
  bonus_rows = (lengths_B == 1) & (num_accepted == 1)
  assert bonus_rows.sum() > 1000
  assert chi_square_pvalue(np.bincount(next_token[bonus_rows], minlength=V), np.float64(target_probs_K1xV[1])) > ALPHA


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


# ---- Mutation checks: each plausible bug of the chain rule fails a test here by a wide margin ----

_FOLD_IN = jax.random.fold_in  # the real one, captured before a mutant patches it


def _fresh_verify():
  """A new function behaving as `acceptance.verify`: jit traces it anew, seeing whatever is patched."""
  return jax.jit(lambda key, proposal_, target: acceptance.verify(key, proposal_, target))


def _random_rows(rng, rows, k):
  """Rows of random draft and target distributions [rows, K, V], [rows, K + 1, V], drafts drawn from
  p and proposal lengths 0..K."""
  draft_probs_BxKxV = rng.dirichlet(np.ones(V), (rows, k)).astype(np.float32)
  target_probs_BxK1xV = rng.dirichlet(np.ones(V), (rows, k + 1)).astype(np.float32)
  cdf_BxKxV = np.cumsum(np.float64(draft_probs_BxKxV), axis=-1)
  draft_BxK = np.minimum((rng.random((rows, k, 1)) * cdf_BxKxV[..., -1:] > cdf_BxKxV).sum(-1), V - 1)
  lengths_B = rng.integers(0, k + 1, rows)
  return (proposal.Proposal(tokens=jnp.asarray(draft_BxK, jnp.int32), lengths=jnp.asarray(lengths_B, jnp.int32),
                            probs=jnp.asarray(draft_probs_BxKxV)), jnp.asarray(target_probs_BxK1xV))


@functools.cache
def _row_key_case():
  """4,096 rows, K = 2: 256 random rows, then 3,840 identical ones (a 1-token proposal of p's most
  likely token, p, q = `PAIRS["random0"]`, bonus from q reversed); the key; what `_verify_row` keyed by
  fold_in(key, b) gives for each row; the identical rows' exact marginal of the next token."""
  rng = np.random.default_rng(20)
  random_rows, rows, k = 256, 4096, 2
  random_proposal, random_target_BxK1xV = _random_rows(rng, random_rows, k)
  p, q = PAIRS["random0"]
  token = int(np.argmax(p))
  same = rows - random_rows
  tokens_BxK = jnp.concatenate([random_proposal.tokens, jnp.full((same, k), token, jnp.int32)])
  lengths_B = jnp.concatenate([random_proposal.lengths, jnp.ones((same,), jnp.int32)])
  probs_BxKxV = jnp.concatenate([random_proposal.probs, jnp.broadcast_to(p, (same, k, V))])
  target_BxK1xV = jnp.concatenate([random_target_BxK1xV, jnp.broadcast_to(np.stack([q, q[::-1], q]), (same, k + 1, V))])
  key = jax.random.key(7)
  keys_B = jax.vmap(lambda b: _FOLD_IN(key, b))(jnp.arange(rows))
  want = jax.jit(jax.vmap(acceptance._verify_row))(keys_B, tokens_BxK, lengths_B, probs_BxKxV, target_BxK1xV)
  p64, q64 = np.float64(p), np.float64(q)
  accept = min(1.0, q64[token] / p64[token])
  marginal = accept * q64[::-1] + (1.0 - accept) * np.float64(acceptance.residual(jnp.asarray(q), jnp.asarray(p)))
  case = proposal.Proposal(tokens=tokens_BxK, lengths=lengths_B, probs=probs_BxKxV), target_BxK1xV
  return case, key, tuple(np.asarray(w) for w in want), marginal, random_rows


def _row_key_statistics(verify):
  """`verify` on `_row_key_case`: (the share of the random rows where it differs from `_verify_row`
  keyed by fold_in(key, b), as its docstring promises; the chi-square p-value of the identical rows'
  next tokens, pooled, against their exact marginal m; the binomial p-value of how often the pairs
  (2i, 2i + 1) of identical rows agree, against sum_x m(x)^2)."""
  (proposal_, target_BxK1xV), key, want, marginal, random_rows = _row_key_case()
  got = [np.asarray(g) for g in verify(key, proposal_, target_BxK1xV)]
  differ_B = (got[0] != want[0]) | (got[1] != want[1])
  next_Z = got[1][random_rows:]
  pooled = chi_square_pvalue(np.bincount(next_Z, minlength=V), marginal)
  agree = int(np.sum(next_Z[0::2] == next_Z[1::2]))
  pairs = stats.binomtest(agree, len(next_Z) // 2, float(np.sum(marginal**2))).pvalue
  return differ_B[:random_rows].mean(), pooled, pairs


def test_rows_are_keyed_by_fold_in_and_independent(monkeypatch):
  """Row b of `verify` equals `_verify_row` keyed by fold_in(key, b) (all of 256 random rows), and
  3,840 identical rows draw independently: their pooled next tokens follow the one-row marginal
  (chi-square) and row pairs agree as often as independent draws do (binomial), both at level 1e-3.
  Mutant: every row keyed by the same key (each row's marginal stays exact): most rows differ from
  `_verify_row`, and both statistics give p < 1e-8."""
  mismatch, pooled, pairs = _row_key_statistics(_fresh_verify())
  assert mismatch == 0 and pooled > ALPHA and pairs > ALPHA, (mismatch, pooled, pairs)
  mutants.inject(monkeypatch, "same_row_key")
  mismatch, pooled, pairs = _row_key_statistics(_fresh_verify())
  assert mismatch > 0.5 and pooled < 1e-8 and pairs < 1e-8, (mismatch, pooled, pairs)


def _bonus_from_q_k(key, proposal_, target_probs_BxK1xV):
  """A broken rule: `verify` with the bonus drawn from q_K instead of q_{K+1}."""
  return acceptance.verify(key, proposal_, target_probs_BxK1xV.at[:, -1].set(target_probs_BxK1xV[:, -2]))


def _joint_pvalue(rule, rows=100_000, seed=6):
  """Chi-square p-value of the joint distribution of the K + 1 = 3 tokens a round emits (draws from
  the target continue a row that emits fewer) against q_1 x q_2 x q_3, position-dependent random p_i
  and q_i of `PAIRS["random1"]`-like shape, drafts drawn from p, N = `rows`."""
  rng = np.random.default_rng(seed)
  k = 2
  draft_probs_KxV = np.stack([_dirichlet(rng) for _ in range(k)]).astype(np.float32)
  target_probs_K1xV = np.stack([_dirichlet(rng) for _ in range(k + 1)]).astype(np.float32)
  draft_BxK = np.stack([rng.choice(V, rows, p=np.float64(p) / np.float64(p).sum()) for p in draft_probs_KxV], axis=1)
  num_accepted, next_token = rule(
      jax.random.key(seed),
      proposal.full(jnp.asarray(draft_BxK, jnp.int32), jnp.broadcast_to(draft_probs_KxV, (rows, k, V))),
      jnp.broadcast_to(target_probs_K1xV, (rows, k + 1, V)))
  num_accepted, next_token = np.asarray(num_accepted), np.asarray(next_token)
  q_K1xV = np.float64(target_probs_K1xV) / np.float64(target_probs_K1xV).sum(-1, keepdims=True)
  continued_BxK1 = np.stack([rng.choice(V, rows, p=q) for q in q_K1xV], axis=1)
  emitted_BxK1 = np.where(
      np.arange(k + 1) < num_accepted[:, None], np.pad(draft_BxK, ((0, 0), (0, 1))),
      np.where(np.arange(k + 1) == num_accepted[:, None], next_token[:, None], continued_BxK1))
  counts = np.bincount(np.ravel_multi_index(emitted_BxK1.T, [V] * (k + 1)), minlength=V**(k + 1))
  expected = q_K1xV[0][:, None, None] * q_K1xV[1][None, :, None] * q_K1xV[2][None, None, :]
  return chi_square_pvalue(counts, expected.ravel())


CHAIN_MUTANTS = ("residual_is_q", "residual_p_minus_q", "inverse_ratio", "bonus_from_q_K")


@pytest.mark.parametrize("mutant", (None,) + CHAIN_MUTANTS)
def test_broken_chain_rules_fail_the_joint_monte_carlo_test(mutant, monkeypatch):
  """The joint of a round's K + 1 = 3 emitted tokens (`_joint_pvalue`, N = 100,000 rows, 1,000 cells,
  fixed seeds): the correct rule passes at level 1e-3, each distinct mutant fails with p < 1e-8:
  residual = q, residual norm(max(0, p - q)), acceptance min(1, p/q), bonus drawn from q_K. (The
  residual not renormalised is no bug for the chain rule: `sample` normalises; shared row keys:
  `test_rows_are_keyed_by_fold_in_and_independent`.)"""
  rule = _fresh_verify()
  if mutant == "bonus_from_q_K":
    rule = jax.jit(lambda *args: _bonus_from_q_k(*args))
  elif mutant is not None:
    mutants.inject(monkeypatch, mutant, chain=True)
  pvalue = _joint_pvalue(rule)
  assert pvalue > ALPHA if mutant is None else pvalue < 1e-8, pvalue


@pytest.mark.parametrize("mutant", ["residual_is_q", "residual_not_renormalised", "residual_p_minus_q"])
def test_broken_residuals_fail_the_enumeration(mutant, monkeypatch):
  """The exact enumeration `test_single_step_output_distribution_is_exactly_q` rejects each residual
  mutant on random p, q."""
  mutants.inject(monkeypatch, mutant, chain=True)
  with pytest.raises(AssertionError):
    test_single_step_output_distribution_is_exactly_q("random0")
