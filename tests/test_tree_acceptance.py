"""The tree acceptance rule alone.

Exact enumeration: on the tree (2, 2) over a vocabulary of 4, with position-dependent random target
and draft distributions, the distribution of the first Dt + 1 = 3 tokens (the round's emitted tokens,
continued by the target's own sampling) equals the target's exactly, for i.i.d., without-replacement
and deterministic children; the same computation with q' not updated after a rejection does not.
Monte Carlo: the jitted `verify_tree` follows the target's distribution of the first two tokens
(chi-square, level 1e-3, 20,000 rows) and fails (p < 1e-6) when its residual update is removed.
Greedy: `verify_tree_greedy` picks the deepest node on the target's argmax chain.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.speculative.trees import acceptance as tree_acceptance
from specjax.speculative.trees import tree as tree_lib
from tests.helpers import mutants
from tests.helpers.stats import chi_square_pvalue

V = 4
TREE = tree_lib.from_branching((2, 2))
LENGTH = TREE.max_depth + 1
MODES = ("iid", "without_replacement", "deterministic")


@functools.cache
def _dist(kind, prefix):
  """A fixed random distribution over V for each (model, prefix): the target's q or the draft's p."""
  seed = 1000 * (kind == "p") + int("".join(str(t + 1) for t in prefix) or "0")
  probs = np.random.default_rng(seed).dirichlet(np.full(V, 0.7))
  return (probs / probs.sum()).astype(np.float64)


def _child_dist(mode, prefix, rank, drawn):
  """The distribution child `rank` of the node at `prefix` is drawn from, given its elder siblings'
  tokens `drawn` (deterministic: the draft's rank-th most likely token)."""
  p = _dist("p", prefix)
  if mode == "deterministic":
    return np.eye(V)[np.argsort(-p, kind="stable")[rank]]
  if mode == "without_replacement":
    p = p.copy()
    p[list(drawn)] = 0.0
    return p / p.sum()
  return p


def _np_residual(q, p, update):
  """The rule's own residual (looked up in `tree_acceptance` at call time, so a patched one is seen)."""
  residual_fn = tree_acceptance.residual
  return np.float64(residual_fn(jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32))) if update else q


def _emitted(mode, prefix, width_left, q_prime, drawn, update):
  """{emitted suffix: probability} from a node at `prefix` whose next children are `width_left`
  (a tuple of branching factors of the levels below), q' the current target residual."""
  if not width_left:
    return {(x,): q_prime[x] for x in range(V) if q_prime[x] > 0}
  rank = len(drawn)
  if rank == width_left[0]:  # every child rejected: a draw from q'
    return {(x,): q_prime[x] for x in range(V) if q_prime[x] > 0}
  p = _child_dist(mode, prefix, rank, drawn)
  out = {}
  for x in np.flatnonzero(p > 0):
    accept = min(1.0, q_prime[x] / p[x])
    child = _emitted(mode, prefix + (x,), width_left[1:], _dist("q", prefix + (x,)), (), update)
    for seq, prob in child.items():
      out[(x,) + seq] = out.get((x,) + seq, 0.0) + p[x] * accept * prob
    if accept < 1.0:
      after = _emitted(mode, prefix, width_left, _np_residual(q_prime, p, update), drawn + (x,), update)
      for seq, prob in after.items():
        out[seq] = out.get(seq, 0.0) + p[x] * (1.0 - accept) * prob
  return out


def _target_prob(seq):
  return np.prod([_dist("q", seq[:i])[seq[i]] for i in range(len(seq))])


def _first_tokens(emitted):
  """The distribution of the first LENGTH tokens: each emitted suffix continued by the target."""
  out = {}
  for seq, prob in emitted.items():
    for rest in itertools.product(range(V), repeat=LENGTH - len(seq)):
      full = seq + rest
      out[full] = out.get(full, 0.0) + prob * _target_prob(full) / _target_prob(seq)
  return out


@pytest.mark.parametrize("mode", MODES)
def test_tree_rule_output_is_exactly_the_target_by_enumeration(mode):
  branching = (2, 2)
  got = _first_tokens(_emitted(mode, (), branching, _dist("q", ()), (), update=True))
  for seq in itertools.product(range(V), repeat=LENGTH):
    np.testing.assert_allclose(got.get(seq, 0.0), _target_prob(seq), atol=1e-6)
  broken = _first_tokens(_emitted(mode, (), branching, _dist("q", ()), (), update=False))
  error = max(abs(broken.get(seq, 0.0) - _target_prob(seq)) for seq in itertools.product(range(V), repeat=LENGTH))
  assert error > 1e-2  # not updating q' after a rejection is visibly inexact


def _groups(keys_ZxCol):
  """(key, row indices) for each distinct row of `keys_ZxCol` [Z, Col] (Col may be 0: one group)."""
  if keys_ZxCol.shape[1] == 0:
    yield (), np.arange(len(keys_ZxCol))
    return
  unique_UxCol, inverse_Z = np.unique(keys_ZxCol, axis=0, return_inverse=True)
  for group, key in enumerate(unique_UxCol):
    yield tuple(int(t) for t in key), np.flatnonzero(inverse_Z.ravel() == group)


def _draw_rows(mode, rows, rng):
  """Tree proposals drawn as `mode` draws them: tokens [rows, N], the distributions they were drawn from
  [rows, N, V] and the target's q at each node [rows, N + 1, V] (vectorised over the rows sharing a
  node's prefix and elder siblings)."""
  paths = TREE.path_table()
  tokens = np.zeros((rows, TREE.nodes_with_root), np.int64)  # column 0 unused (the root)
  probs = np.zeros((rows, TREE.nodes_with_root, V))
  for node in range(1, TREE.nodes_with_root):
    parent = TREE.parent[node]
    depth = TREE.depth[parent]
    elders = [c for c in TREE.children(parent) if c < node]
    for key, rows_Z in _groups(tokens[:, list(paths[parent, 1:depth + 1]) + elders]):
      p = _child_dist(mode, key[:depth], len(elders), key[depth:])
      tokens[rows_Z, node] = rng.choice(V, size=len(rows_Z), p=p)
      probs[rows_Z, node] = p
  target = np.zeros((rows, TREE.nodes_with_root, V))
  for node in range(TREE.nodes_with_root):
    for key, rows_Z in _groups(tokens[:, paths[node, 1:TREE.depth[node] + 1]]):
      target[rows_Z, node] = _dist("q", key)
  return tokens[:, 1:], probs[:, 1:], target


MC_ROWS = 60_000  # per mode


@functools.cache
def _drawn_all_modes():
  """`_draw_rows` of every mode (fixed seed; deterministic children as one-hot distributions, which the
  rule treats exactly as point masses), stacked into one batch of 3 x MC_ROWS rows (read-only): one
  compiled program serves every mode."""
  drawn = [_draw_rows(mode, MC_ROWS, np.random.default_rng(0)) for mode in MODES]
  return tuple(np.concatenate(parts) for parts in zip(*drawn))


def _fresh_verify_tree():
  """A new function behaving as `verify_tree`: jit traces it anew, seeing whatever is patched."""
  return jax.jit(lambda *args: tree_acceptance.verify_tree(*args), static_argnums=1)


def _round_pvalues(seed=0):
  """One jitted `verify_tree` call on `_drawn_all_modes()`. Returns per mode the chi-square p-value of
  the joint of the first Dt + 1 = 3 tokens (the accepted path, the next token, which is the bonus after
  a full-depth path, and draws from the target continuing a shorter round) against the target's, over
  V^3 = 64 cells, and the share of rows whose path reached full depth."""
  tokens, probs, target = _drawn_all_modes()
  path, accepted, next_token = _fresh_verify_tree()(jax.random.key(seed), TREE, jnp.asarray(tokens, jnp.int32),
                                                    jnp.asarray(probs, jnp.float32), jnp.asarray(target, jnp.float32))
  path, accepted, next_token = np.asarray(path), np.asarray(accepted), np.asarray(next_token)
  path_tokens_ZxDt = np.take_along_axis(tokens, np.maximum(path[:, 1:] - 1, 0), axis=1)
  position_T = np.arange(LENGTH)
  emitted_ZxT = np.where(position_T < accepted[:, None], np.pad(path_tokens_ZxDt, ((0, 0), (0, 1))), next_token[:,
                                                                                                                None])
  rng = np.random.default_rng(seed + 1)
  for position in range(1, LENGTH):  # continued by the target after a short round
    short_Z = np.flatnonzero(accepted < position)
    for key, rows_Z in _groups(emitted_ZxT[short_Z, :position]):
      emitted_ZxT[short_Z[rows_Z], position] = rng.choice(V, size=len(rows_Z), p=_dist("q", key))
  expected = np.array([_target_prob(seq) for seq in itertools.product(range(V), repeat=LENGTH)])
  out = {}
  for index, mode in enumerate(MODES):
    rows = slice(index * MC_ROWS, (index + 1) * MC_ROWS)
    counts = np.bincount(np.ravel_multi_index(emitted_ZxT[rows].T, [V] * LENGTH), minlength=V**LENGTH)
    out[mode] = chi_square_pvalue(counts, expected), np.mean(accepted[rows] == TREE.max_depth)
  return out


TREE_MUTANTS = ("residual_is_q", "residual_not_renormalised", "residual_p_minus_q", "inverse_ratio",
                "bonus_from_residual", "shared_sibling_uniform")
# Where a mutant's effect is too small for a wide margin: a uniform shared by the siblings of a level
# gives p = 0.13 (i.i.d.) and 2e-9 (without replacement) at N = 60,000; point masses catch it (p = 0).
WEAK = {("shared_sibling_uniform", "iid"), ("shared_sibling_uniform", "without_replacement")}


@pytest.mark.parametrize("mutant", (None,) + TREE_MUTANTS)
def test_verify_tree_follows_the_target_by_monte_carlo(mutant, monkeypatch):
  """The joint of the Dt + 1 = 3 tokens of a round of the tree (2, 2), bonus included (`_round_pvalues`:
  N = 60,000 rows per mode, 64 cells, fixed seeds; full depth, hence a bonus, in 48%, 56% and 9% of the
  rows for i.i.d., without-replacement and deterministic children): the correct rule passes at level
  1e-3 in every mode, each distinct mutant (`tests.helpers.mutants`) fails with p < 1e-8 in every mode
  but `WEAK`: q' never updated, residual not renormalised, residual norm(max(0, p - q)), acceptance
  min(1, p/q), the bonus from the last residual instead of the leaf's q, one uniform shared by the
  siblings of a level. Measured: the correct rule p = 0.29, 0.80, 0.36; every mutant outside `WEAK`
  p < 1e-127 (most underflow to 0). Cost: one compile per case (~2 s on 2 busy cores)."""
  if mutant is not None:
    mutants.inject(monkeypatch, mutant, tree=True)
  for mode, (pvalue, full_depth) in _round_pvalues().items():
    if mutant is None:
      assert full_depth > 0.05 and pvalue > 1e-3, (mode, full_depth, pvalue)
    elif (mutant, mode) not in WEAK:
      assert pvalue < 1e-8, (mode, pvalue)


def test_greedy_takes_the_deepest_path_on_the_argmax_chain():
  tree = tree_lib.from_paths([[0], [1], [0, 0], [1, 0], [1, 0, 0]])  # 1, 2, 3 (0,0), 4 (1,0), 5
  target = np.full((3, tree.nodes_with_root), 9)
  target[:, 0], target[:, 2], target[:, 4] = 7, 8, 6  # the argmax chain 7, 8, 6 runs through 2, 4
  tokens = np.array([
      [5, 7, 1, 8, 6],  # all the way down node 2 -> 4 -> 5: 3 accepted, then t_5
      [7, 5, 9, 8, 6],  # node 1 matches, its child 3 (9 = t_1) too: 2 accepted
      [5, 5, 5, 5, 5]
  ])  # nothing
  path, accepted, next_token = tree_acceptance.verify_tree_greedy(tree, jnp.asarray(tokens), jnp.asarray(target))
  np.testing.assert_array_equal(accepted, [3, 2, 0])
  np.testing.assert_array_equal(path, [[0, 2, 4, 5], [0, 1, 3, 3], [0, 0, 0, 0]])
  np.testing.assert_array_equal(next_token, [9, 9, 7])


def test_greedy_equals_the_sampled_rule_on_one_hot_distributions():
  """Random trees with distinct siblings, under a target whose argmax depends on the path only (with
  duplicate siblings greedy may go deeper, through a later twin)."""
  rng = np.random.default_rng(3)
  tokens = np.concatenate([rng.permuted(np.tile(np.arange(V), (64, 1)), axis=1)[:, :2] for _ in range(1 + 2)],
                          axis=1)  # the root's, node 1's and node 2's children
  paths = TREE.path_table()
  target_tokens = np.array([[
      np.argmax(_dist("q", tuple(tokens[row, paths[n, 1:TREE.depth[n] + 1] - 1]))) for n in range(TREE.nodes_with_root)
  ] for row in range(64)])
  greedy = jax.jit(tree_acceptance.verify_tree_greedy, static_argnums=0)(TREE, jnp.asarray(tokens),
                                                                         jnp.asarray(target_tokens))
  sampled = jax.jit(tree_acceptance.verify_tree, static_argnums=1)(  # op by op: ~10 s
      jax.random.key(0), TREE, jnp.asarray(tokens, jnp.int32), None, jax.nn.one_hot(target_tokens, V))
  for a, b in zip(greedy, sampled):
    np.testing.assert_array_equal(a, b)


_FOLD_IN = jax.random.fold_in  # the real one, captured before a mutant patches it
KEY_TREE = tree_lib.from_branching((2,))  # small: three compiled programs for the row-key check


@functools.cache
def _row_key_case():
  """4,096 rows of KEY_TREE: 256 random ones (i.i.d. children drawn from p), then 3,840 copies of one
  row, and what `_verify_tree_row` keyed by fold_in(key, b) gives for each."""
  rng = np.random.default_rng(30)
  random_rows, rows = 256, 4096
  p, q = _dist("p", ()), _dist("q", ())
  tokens_BxN = rng.choice(V, (rows, 2), p=p)
  tokens_BxN[random_rows:] = [0, 1]
  target_BxN1xV = np.stack([np.broadcast_to(q, (rows, V))] +
                           [np.stack([_dist("q", (int(t),)) for t in tokens_BxN[:, n]]) for n in range(2)], axis=1)
  probs_BxNxV = np.broadcast_to(p, (rows, 2, V))
  args = (jnp.asarray(tokens_BxN, jnp.int32), jnp.asarray(probs_BxNxV,
                                                          jnp.float32), jnp.asarray(target_BxN1xV, jnp.float32))
  key = jax.random.key(8)
  keys_B = jax.vmap(lambda b: _FOLD_IN(key, b))(jnp.arange(rows))
  _, depth_BxN1, children_BxN1xC, path_BxN1xDt1, _ = tree_acceptance._tables(KEY_TREE, rows)
  want = jax.jit(jax.vmap(tree_acceptance._verify_tree_row))(keys_B, children_BxN1xC, path_BxN1xDt1, depth_BxN1, *args)
  return key, args, tuple(np.asarray(w) for w in want), random_rows


def _identical_row_marginal():
  """The exact distribution of (last path node) * V + next token for the identical rows of
  `_row_key_case` (children 0 and 1 of the root, i.i.d. from p), by the tree rule in float64."""
  p, q = _dist("p", ()), _dist("q", ())
  norm_residual = lambda q_, p_: np.maximum(q_ - p_, 0.0) / np.maximum(q_ - p_, 0.0).sum()
  marginal = np.zeros(3 * V)
  accept_first = min(1.0, q[0] / p[0])
  marginal[V:2 * V] = accept_first * _dist("q", (0,))
  q_prime = norm_residual(q, p)
  accept_second = min(1.0, q_prime[1] / p[1])
  marginal[2 * V:] = (1 - accept_first) * accept_second * _dist("q", (1,))
  marginal[:V] = (1 - accept_first) * (1 - accept_second) * norm_residual(q_prime, p)
  return marginal


def _row_key_statistics(verify_tree):
  """`verify_tree` on `_row_key_case`: (the share of the random rows where it differs from
  `_verify_tree_row` keyed by fold_in(key, b), as its docstring promises; for the identical rows'
  outcomes (last path node, next token), the chi-square p-value of their pooled counts against the
  exact marginal m, and the binomial p-value of how often the pairs (2i, 2i + 1) agree, against
  sum_x m(x)^2)."""
  key, args, want, random_rows = _row_key_case()
  got = [np.asarray(g) for g in verify_tree(key, KEY_TREE, *args)]
  differ_B = np.any(got[0] != want[0], axis=1) | (got[1] != want[1]) | (got[2] != want[2])
  outcome_Z = got[0][random_rows:, -1] * V + got[2][random_rows:]
  marginal = _identical_row_marginal()
  pooled = chi_square_pvalue(np.bincount(outcome_Z, minlength=3 * V), marginal)
  agree = int(np.sum(outcome_Z[0::2] == outcome_Z[1::2]))
  pairs = stats.binomtest(agree, len(outcome_Z) // 2, float(np.sum(marginal**2))).pvalue
  return differ_B[:random_rows].mean(), pooled, pairs


def test_rows_are_keyed_by_fold_in_and_independent(monkeypatch):
  """Row b of `verify_tree` equals `_verify_tree_row` keyed by fold_in(key, b) (all of 256 random
  rows) and 3,840 identical rows draw independently: their pooled outcomes follow the one-row marginal
  (chi-square) and row pairs agree as often as independent draws (binomial), both at level 1e-3.
  Mutant: every row keyed by the same key (each row's marginal stays exact): most rows differ from
  `_verify_tree_row`, and both statistics give p < 1e-8."""
  mismatch, pooled, pairs = _row_key_statistics(_fresh_verify_tree())
  assert mismatch == 0 and pooled > 1e-3 and pairs > 1e-3, (mismatch, pooled, pairs)
  mutants.inject(monkeypatch, "same_row_key")
  mismatch, pooled, pairs = _row_key_statistics(_fresh_verify_tree())
  assert mismatch > 0.5 and pooled < 1e-8 and pairs < 1e-8, (mismatch, pooled, pairs)


@pytest.mark.parametrize("mutant", ["residual_not_renormalised", "residual_p_minus_q"])
@pytest.mark.parametrize("mode", MODES)
def test_broken_residuals_fail_the_enumeration(mode, mutant, monkeypatch):
  """The exact enumeration of the tree rule (`_emitted`, which uses the rule's own residual) with a
  mutant residual patched into `tree_acceptance`: the distribution of the first 3 tokens is off by
  more than 1e-2 somewhere (the correct one matches to 1e-6:
  `test_tree_rule_output_is_exactly_the_target_by_enumeration`; q' never updated is its own check)."""
  mutants.inject(monkeypatch, mutant, tree=True)
  got = _first_tokens(_emitted(mode, (), (2, 2), _dist("q", ()), (), update=True))
  error = max(abs(got.get(seq, 0.0) - _target_prob(seq)) for seq in itertools.product(range(V), repeat=LENGTH))
  assert error > 1e-2, error
