"""Exact verification of a static draft tree (SpecInfer's multi-step speculative sampling): pure
functions on probabilities, in float32.

The proposal: draft token x_i at every node i = 1..N of a tree (a static `tree.Tree`, or one per row:
`dynamic_tree.DynamicTree`), drawn from p_i, the
distribution it was actually drawn from given everything drawn before it: the draft's distribution at
its parent for i.i.d. children; that distribution with the earlier siblings removed and renormalised
for children drawn without replacement; a point mass for deterministic children (top-b, or every
child when greedy), given as `probs = None`. The target scored every node: q_i = its distribution
after node i's root-to-node path.

The rule, per row: start at the root with q' = q_0. At the current node c try its children in rank
order: child x (drawn from p) is accepted with probability min(1, q'(x) / p(x)); then c <- that child,
q' <- q_c, and the next level starts. On a rejection q' <- norm(max(q' - p, 0)) and the next sibling is
tried. If every child of c is rejected (or c is a leaf), the next token is drawn from q'.

Why it is exact (sketch, by induction over the children left to try at a node): claim: whatever the
earlier siblings drew, the token emitted after the current node is distributed as the current q'.
With one child left of distribution p (fixed by the history), it is emitted as x with probability
p(x) min(1, q'(x)/p(x)) = min(p(x), q'(x)), and rejected with total probability
1 - sum min(p, q') = sum max(q' - p, 0) = Z, after which the rest gives norm(max(q' - p, 0)) by the
hypothesis (that residual depends on p, not on the rejected x); so the token is x with probability
min(p(x), q'(x)) + max(q'(x) - p(x), 0) = q'(x). Without replacement the next sibling's p changes
with x, but the hypothesis holds for every p. Once a child x is accepted, its subtree was drawn
given x only, so the same argument applies one level down with q' = q_x, the target's distribution
after x: the emitted sequence is distributed as the target's own sampling. (Z = 0 means p = q' up to
rounding: rejection has probability 0; `acceptance.residual` then falls back to q'.)

Greedy (`verify_tree_greedy`): the deepest node whose whole path equals the target's argmax chain
(the first such node in numbering order), then the target's argmax there: the rule above on one-hot q
when siblings are distinct (with duplicate siblings it may also go down a later twin, deeper).

Both return per row the accepted path as node indices [Dt + 1] (entry 0 the root, padded with the
last accepted node), the number of accepted draft tokens (its depth) and the next token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.attention_mask import per_row
from specjax.sampling import sample
from specjax.speculative.acceptance import _probability_of, residual
from specjax.speculative.trees.dynamic import DynamicTree
from specjax.speculative.trees.tree import Tree


def _try_child(uniform, child, tokens_N, probs_NxW, q_V):
  """One trial of a child node (index >= 1): (accepted, q' after a rejection)."""
  token = tokens_N[child - 1]
  if probs_NxW is None:
    p_x = jnp.float32(1.0)
    p_W = jax.nn.one_hot(token, q_V.shape[-1], dtype=jnp.float32)  # all zeros for ids >= V
  else:
    p_W = probs_NxW[child - 1]
    p_x = _probability_of(p_W[None], token[None])[0]
  q_x = _probability_of(q_V[None], token[None])[0]
  return uniform * p_x < q_x, residual(q_V, p_W)


def _verify_tree_row(key, children_N1xC, path_N1xDt1, depth_N1, tokens_N, probs_NxW, target_probs_N1xV):
  depth, width = path_N1xDt1.shape[1] - 1, children_N1xC.shape[1]
  uniform_key, sample_key = jax.random.split(key)
  uniforms_DtxC = jax.random.uniform(uniform_key, (depth, width), jnp.float32)
  node, q_V, searching = jnp.int32(0), target_probs_N1xV[0], jnp.bool_(True)
  for level in range(depth):
    found, next_node = jnp.bool_(False), node
    for rank in range(width):
      child = children_N1xC[node, rank]
      trying = searching & ~found & (child > 0)
      accepted, rejected_q_V = _try_child(uniforms_DtxC[level, rank], jnp.maximum(child, 1), tokens_N, probs_NxW, q_V)
      q_V = jnp.where(trying & ~accepted, rejected_q_V, q_V)
      next_node = jnp.where(trying & accepted, child, next_node)
      found = found | (trying & accepted)
    node, searching = next_node, found
    q_V = jnp.where(found, target_probs_N1xV[node], q_V)
  return path_N1xDt1[node], depth_N1[node], sample(sample_key, q_V)


def _tables(tree, batch: int) -> tuple[jax.Array, ...]:
  """Per-row [B, ...] tables of a static `tree.Tree` (broadcast) or a per-row `dynamic_tree.DynamicTree`:
  parents [N + 1], depths [N + 1], children [N + 1, C], paths [N + 1, Dt + 1], ancestor mask [N + 1, N + 1]."""
  return (per_row(tree.parent, batch, 1), per_row(tree.depth, batch, 1), per_row(tree.children_table(), batch, 2),
          per_row(tree.path_table(), batch, 2), per_row(tree.ancestor_mask(), batch, 2))


def verify_tree(key: jax.Array, tree: Tree | DynamicTree, tokens_BxN: jax.Array, probs_BxNxW: jax.Array | None,
                target_probs_BxN1xV: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The tree rule of the module docstring, row b keyed by `fold_in(key, b)`.

  Args:
    key: this round's PRNG key.
    tree: the static tree.
    tokens_BxN: draft tokens of nodes 1..N.
    probs_BxNxW: float32 distribution each node's token was drawn from (see the module docstring; W may
      differ from V: extended with zeros or cut, as in `acceptance`), or None for point masses.
    target_probs_BxN1xV: float32 target distributions q_0..q_N, q_i scored at node i.

  Returns:
    path_BxDt1: int32 accepted path (node indices, root first, padded with the last accepted node).
    num_accepted_B: int32 draft tokens accepted (the depth of the last accepted node).
    next_token_B: int32 the token drawn after them.
  """
  batch = tokens_BxN.shape[0]
  row_keys_B = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))
  _, depth_BxN1, children_BxN1xC, path_BxN1xDt1, _ = _tables(tree, batch)
  if probs_BxNxW is None:
    return jax.vmap(lambda key, children, paths, depths, tokens, target: _verify_tree_row(
        key, children, paths, depths, tokens, None, target))(row_keys_B, children_BxN1xC, path_BxN1xDt1, depth_BxN1,
                                                             tokens_BxN, target_probs_BxN1xV)
  return jax.vmap(_verify_tree_row)(row_keys_B, children_BxN1xC, path_BxN1xDt1, depth_BxN1, tokens_BxN, probs_BxNxW,
                                    target_probs_BxN1xV)


def verify_tree_greedy(tree: Tree | DynamicTree, tokens_BxN: jax.Array,
                       target_tokens_BxN1: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The greedy tree rule on token ids: the deepest node whose path equals the target's argmax chain.

  Args:
    tree: the static tree.
    tokens_BxN: draft tokens of nodes 1..N.
    target_tokens_BxN1: int32 target argmaxes t_0..t_N, t_i scored at node i.

  Returns: (path_BxDt1, num_accepted_B, next_token_B) as `verify_tree`, next = t at the last accepted node.
  """
  parent_BxN1, depth_BxN1, _, path_BxN1xDt1, ancestors_BxN1xN1 = _tables(tree, tokens_BxN.shape[0])
  matches_BxN = tokens_BxN == jnp.take_along_axis(target_tokens_BxN1, parent_BxN1[:, 1:], axis=1)
  matches_BxN1 = jnp.pad(matches_BxN, ((0, 0), (1, 0)), constant_values=True)
  # A node is reachable when every node on its path (ancestor mask row) matches.
  reachable_BxN1 = ~jnp.any(ancestors_BxN1xN1 & ~matches_BxN1[:, None, :], axis=-1)
  node_B = jnp.argmax(jnp.where(reachable_BxN1, depth_BxN1, -1), axis=-1)  # the first deepest
  row_B = jnp.arange(node_B.shape[0])
  return path_BxN1xDt1[row_B, node_B], depth_BxN1[row_B, node_B], target_tokens_BxN1[row_B, node_B]
