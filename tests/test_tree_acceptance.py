"""The tree acceptance rule alone.

Exact enumeration: on the tree (2, 2) over a vocabulary of 4, with position-dependent random target
and draft distributions, the distribution of the first D + 1 = 3 tokens (the round's emitted tokens,
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

from specjax.speculative import tree_acceptance
from specjax.speculative import tree as tree_lib
from specjax.speculative.acceptance import residual
from tests.test_acceptance import chi_square_pvalue

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
  return np.float64(residual(jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32))) if update else q


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


def _draw_rows(mode, rows, rng):
  """Tree proposals drawn as `mode` draws them: tokens [rows, N], the distributions they were drawn from
  [rows, N, V] and the target's q at each node [rows, N + 1, V]."""
  paths = TREE.path_table()
  tokens = np.zeros((rows, TREE.num_nodes), np.int64)  # column 0 unused (the root)
  probs = np.zeros((rows, TREE.num_nodes, V))
  for row in range(rows):
    for node in range(1, TREE.num_nodes):
      parent = TREE.parent[node]
      prefix = tuple(tokens[row, paths[parent, 1:TREE.depth[parent] + 1]])
      elders = [c for c in TREE.children(parent) if c < node]
      p = _child_dist(mode, prefix, len(elders), tuple(tokens[row, elders]))
      tokens[row, node] = rng.choice(V, p=p)
      probs[row, node] = p
  target = np.stack([[_dist("q", tuple(tokens[row, paths[n, 1:TREE.depth[n] + 1]]))
                      for n in range(TREE.num_nodes)] for row in range(rows)])
  return tokens[:, 1:], probs[:, 1:], target


def _first_two_counts(mode, rows, rng, seed):
  tokens, probs, target = _draw_rows(mode, rows, rng)
  # A fresh function each call: jit would otherwise reuse a program traced before a patch.
  verify = jax.jit(lambda *args: tree_acceptance.verify_tree(*args), static_argnums=1)
  path, accepted, next_token = verify(jax.random.key(seed), TREE, jnp.asarray(tokens, jnp.int32),
                                      None if mode == "deterministic" else jnp.asarray(probs, jnp.float32),
                                      jnp.asarray(target, jnp.float32))
  path, accepted, next_token = np.asarray(path), np.asarray(accepted), np.asarray(next_token)
  counts = np.zeros((V, V))
  for row in range(rows):
    emitted = [tokens[row, n - 1] for n in path[row, 1:accepted[row] + 1]] + [next_token[row]]
    if len(emitted) == 1:  # continued by the target
      emitted.append(rng.choice(V, p=_dist("q", (emitted[0],))))
    counts[emitted[0], emitted[1]] += 1
  expected = np.array([[_target_prob((a, b)) for b in range(V)] for a in range(V)])
  return chi_square_pvalue(counts.ravel(), expected.ravel())


@pytest.mark.parametrize("mode", MODES)
def test_verify_tree_follows_the_target_by_monte_carlo(mode, monkeypatch):
  assert _first_two_counts(mode, 20_000, np.random.default_rng(0), seed=0) > 1e-3
  monkeypatch.setattr(tree_acceptance, "residual", lambda q, p: q)  # q' never updated
  assert _first_two_counts(mode, 20_000, np.random.default_rng(0), seed=0) < 1e-6


def test_greedy_takes_the_deepest_path_on_the_argmax_chain():
  tree = tree_lib.from_paths([[0], [1], [0, 0], [1, 0], [1, 0, 0]])  # 1, 2, 3 (0,0), 4 (1,0), 5
  target = np.full((3, tree.num_nodes), 9)
  target[:, 0], target[:, 2], target[:, 4] = 7, 8, 6  # the argmax chain 7, 8, 6 runs through 2, 4
  tokens = np.array([[5, 7, 1, 8, 6],   # all the way down node 2 -> 4 -> 5: 3 accepted, then t_5
                     [7, 5, 9, 8, 6],   # node 1 matches, its child 3 (9 = t_1) too: 2 accepted
                     [5, 5, 5, 5, 5]])  # nothing
  path, accepted, next_token = tree_acceptance.verify_tree_greedy(tree, jnp.asarray(tokens), jnp.asarray(target))
  np.testing.assert_array_equal(accepted, [3, 2, 0])
  np.testing.assert_array_equal(path, [[0, 2, 4, 5], [0, 1, 3, 3], [0, 0, 0, 0]])
  np.testing.assert_array_equal(next_token, [9, 9, 7])


def test_greedy_equals_the_sampled_rule_on_one_hot_distributions():
  """Random trees with distinct siblings, under a target whose argmax depends on the path only (with
  duplicate siblings greedy may go deeper, through a later twin)."""
  rng = np.random.default_rng(3)
  tokens = np.concatenate([rng.permuted(np.tile(np.arange(V), (64, 1)), axis=1)[:, :2]
                           for _ in range(1 + 2)], axis=1)  # the root's, node 1's and node 2's children
  paths = TREE.path_table()
  target_tokens = np.array([[np.argmax(_dist("q", tuple(tokens[row, paths[n, 1:TREE.depth[n] + 1] - 1])))
                             for n in range(TREE.num_nodes)] for row in range(64)])
  greedy = tree_acceptance.verify_tree_greedy(TREE, jnp.asarray(tokens), jnp.asarray(target_tokens))
  sampled = tree_acceptance.verify_tree(jax.random.key(0), TREE, jnp.asarray(tokens, jnp.int32), None,
                                        jax.nn.one_hot(target_tokens, V))
  for a, b in zip(greedy, sampled):
    np.testing.assert_array_equal(a, b)
