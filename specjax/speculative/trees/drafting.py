"""A draft model proposing a static tree (`tree.Tree`): the children of each node are drawn from the
draft's distribution there, level by level.

Children of a node (`children`, static):
- "iid": independent draws from the node's distribution p (each child's p is that distribution);
- "without_replacement": distinct draws (Gumbel top-b: sequential sampling without replacement); child
  r's distribution is p with its elder siblings removed, renormalised (a point mass on its token when
  nothing is left: a top-k / top-p support smaller than the branching);
- "top": the b most likely tokens, as point masses.
Greedy decoding always takes the b largest logits (point masses). These are exactly the "drawn from"
distributions `tree_acceptance` needs.

Passes: the root is fed by the drafter's catch-up pass (with whatever the draft cache lags by), then
one tree-masked pass per depth level (`Tree.level`): level d's nodes are written after the levels above
(uncommitted slots) and attend to the committed cache and their ancestors there; its hidden states give
the next level's children. A last pass feeds the leaves, so the draft cache holds every node's keys and
the accepted path is compacted like the target's (no lagging token): Dt + 1 passes in all. A round of
the adaptive K policy drafts only the tree cut at its chosen depth d (the catch-up and d passes;
`grow_tree`), and a round that verifies only the cut's spine draws only the spine, as a chain: each
pass feeds one node, not a level (`spine_or_whole`). `draft_static` is that round's drafting, shared
by the model and EAGLE drafters.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import inplace
from specjax.sampling import SamplingParams, probabilities, sample
from specjax.speculative.plan import RoundPlan
from specjax.speculative.trees.tree import Tree, chain

CHILDREN = ("iid", "without_replacement", "top")


def children_error(tree_children: str) -> str | None:
  """Why `tree_children` is not a way to draw a static tree's children (None when it is one)."""
  return None if tree_children in CHILDREN else f"tree_children must be one of {CHILDREN}, got {tree_children!r}"


def _next_level(tree: Tree, depth: int) -> tuple[list[int], list[int], list[int]]:
  """Static plan of level `depth + 1`: its nodes, their parents' offsets within level `depth`, ranks."""
  first = tree.depth.index(depth)
  nodes = [i for i, d in enumerate(tree.depth) if d == depth + 1]
  parents = [tree.parent[i] - first for i in nodes]
  ranks = [tree.children(tree.parent[i]).index(i) for i in nodes]
  return nodes, parents, ranks


def _without_elders(probs_BxCxW: jax.Array, order_BxCxRk: jax.Array, ranks: list[int],
                    tokens_BxC: jax.Array) -> jax.Array:
  """Each child's distribution given its elder siblings: p without their tokens, renormalised (a point
  mass on the child's token where nothing is left)."""
  width = probs_BxCxW.shape[-1]
  elder_CxRk = jnp.arange(order_BxCxRk.shape[-1])[None, :] < jnp.asarray(ranks)[:, None]
  elders_BxCxW = jnp.any(
      (order_BxCxRk[..., None] == jnp.arange(width)[None, None, None, :]) & elder_CxRk[None, :, :, None], axis=2)
  left_BxCxW = jnp.where(elders_BxCxW, 0.0, probs_BxCxW)
  total_BxCx1 = left_BxCxW.sum(-1, keepdims=True)
  return jnp.where(total_BxCx1 > 0.0, left_BxCxW / jnp.where(total_BxCx1 > 0.0, total_BxCx1, 1.0),
                   jax.nn.one_hot(tokens_BxC, width, dtype=jnp.float32))


def _draw_children(children: str, sampling: SamplingParams, key: jax.Array, logits_BxLvxW: jax.Array,
                   parents: list[int], ranks: list[int]) -> tuple[jax.Array, jax.Array | None]:
  """Tokens [B, C] of the next level's C nodes and their distributions [B, C, W] (None: point masses),
  under `sampling`'s constraint at the level's nodes (states [B, Lv]: each parent's own path's)."""
  most = max(ranks) + 1
  pick = lambda order_BxLvxRk: order_BxLvxRk[:, jnp.asarray(parents), jnp.asarray(ranks)]
  if sampling.greedy:
    return pick(jax.lax.top_k(sampling.constraint.mask(logits_BxLvxW), most)[1]), None
  probs_BxLvxW = probabilities(logits_BxLvxW, sampling)
  if children == "top":
    return pick(jax.lax.top_k(probs_BxLvxW, most)[1]), None
  probs_BxCxW = probs_BxLvxW[:, jnp.asarray(parents)]
  if children == "iid":
    return sample(key, probs_BxCxW), probs_BxCxW
  gumbel_BxLvxW = jax.random.gumbel(key, probs_BxLvxW.shape, jnp.float32)
  order_BxLvxRk = jax.lax.top_k(jnp.log(probs_BxLvxW) + gumbel_BxLvxW, most)[1]
  tokens_BxC = pick(order_BxLvxRk).astype(jnp.int32)
  return tokens_BxC, _without_elders(probs_BxCxW, order_BxLvxRk[:, jnp.asarray(parents)], ranks, tokens_BxC)


Drawn = tuple[jax.Array, jax.Array | None]  # tokens [B, n] of a tree's nodes 1..n, their distributions [B, n, W]


def spine_or_whole(tree: Tree, spine: jax.Array | None, draw: Callable[[Tree, Any], tuple[Any, Drawn]],
                   operand: Any) -> tuple[Any, Drawn]:
  """`draw(tree, operand)` -> (operand, (tokens, distributions)) of the tree's nodes, updating `operand`
  (a cache) in place; where `spine` ([] bool, None: never) holds, `draw` the tree's spine as a chain
  instead (`Tree.spine`: what the round verifies) and place its tokens at the spine's nodes (the other
  nodes hold zeros: never verified)."""
  if spine is None:
    return draw(tree, operand)
  nodes = np.asarray(tree.spine())

  def spine_only(operand):
    operand, (tokens_BxDs, probs_BxDsxW) = draw(chain(len(nodes) - 1), operand)
    slots = jnp.asarray(nodes[1:] - 1)
    tokens_BxN = jnp.zeros((tokens_BxDs.shape[0], tree.nodes_with_root - 1), jnp.int32).at[:, slots].set(tokens_BxDs)
    probs_BxNxW = None if probs_BxDsxW is None else jnp.zeros(
        (*tokens_BxN.shape, probs_BxDsxW.shape[-1]), jnp.float32).at[:, slots].set(probs_BxDsxW)
    return operand, (tokens_BxN, probs_BxNxW)

  return inplace.cond(spine, spine_only, lambda operand: draw(tree, operand), operand)


class Grower(NamedTuple):
  """How a drafter feeds a static tree's levels (`grow_tree`)."""

  # feed_level(carry, tokens_BxLv, level, depth) -> (outputs, carry): feeds level `depth`'s tokens (a
  # `TreeLevel` chunk)
  feed_level: Callable
  head: Callable  # head(outputs) -> their logits [B, Lv, W]
  feeds_leaves: bool = False  # the deepest level is fed too (no head: a draft cache then holds every node)
  root_outputs: Any = None  # the root's outputs when the caller fed it (level 0 is not fed again)


def grow_tree(tree: Tree, children: str, root_B: jax.Array, sampling: SamplingParams, key: jax.Array, grower: Grower,
              carry: Any, plan: RoundPlan) -> tuple[jax.Array, jax.Array | None, Any]:
  """Draws a static tree level by level with `grower`: each node's children are drawn from its logits
  (`children`), masked by `sampling`'s constraint at that node (its state after the node's path from
  the root, whose state `sampling` holds: `Constrained.along`).

  Only the tree cut at the plan's depth is drawn (`Tree.cut`, what the round verifies): levels below it
  are neither fed (but the cut's leaves, with `feeds_leaves`) nor drawn, so a shallow round costs only
  its own levels' passes; their tokens stay zeros.

  Returns the tokens [B, N] of nodes 1..N, the distributions [B, N, W] they were drawn from (None for
  point masses) and the last carry.
  """
  feed_level, head, feeds_leaves, root_outputs = grower
  batch = root_B.shape[0]
  tokens_BxN1 = jnp.zeros((batch, tree.nodes_with_root), jnp.int32).at[:, 0].set(root_B)
  level_keys = jax.random.split(key, tree.max_depth)

  def fed(level_depth):
    def run(loop):
      carry, tokens_BxN1, probs = loop
      level = tree.level(level_depth)
      outputs, carry = feed_level(carry, tokens_BxN1[:, level.first:level.first + level.count], level, level_depth)
      return (carry, tokens_BxN1, probs), outputs

    return run

  def drawn(level_depth, outputs):
    def run(loop):
      carry, tokens_BxN1, probs_BxN1xW = loop
      nodes, parents, ranks = _next_level(tree, level_depth)
      level = tree.level(level_depth)  # the parents: their states after their own paths
      states = sampling.constraint.along(tokens_BxN1[:, 1:], tree).at(np.arange(level.first, level.first + level.count))
      level_tokens_BxC, level_probs_BxCxW = _draw_children(children, sampling.replace(constraint=states),
                                                           level_keys[level_depth], head(outputs), parents, ranks)
      tokens_BxN1 = tokens_BxN1.at[:, jnp.asarray(nodes)].set(level_tokens_BxC)
      if level_probs_BxCxW is not None:
        probs_BxN1xW = probs_BxN1xW.at[:, jnp.asarray(nodes)].set(level_probs_BxCxW)
      return (carry, tokens_BxN1, probs_BxN1xW), ()

    return run

  loop = (carry, tokens_BxN1, None)
  if not (sampling.greedy or children == "top"):  # each node's distribution, allocated once
    first = (lambda loop: root_outputs) if root_outputs is not None else (lambda loop: fed(0)(loop)[1])
    width = jax.eval_shape(lambda loop: head(first(loop)), loop).shape[-1]
    loop = (carry, tokens_BxN1, jnp.zeros((batch, tree.nodes_with_root, width), jnp.float32))
  for level_depth in range(tree.max_depth + feeds_leaves):
    if level_depth == 0 and root_outputs is not None:
      outputs = root_outputs
    else:
      loop, outputs = plan.beyond(level_depth - feeds_leaves, fed(level_depth), loop)
    if level_depth < tree.max_depth:
      loop, _ = plan.beyond(level_depth, drawn(level_depth, outputs), loop)
  carry, tokens_BxN1, probs_BxN1xW = loop
  return tokens_BxN1[:, 1:], None if probs_BxN1xW is None else probs_BxN1xW[:, 1:], carry


def draft_static(tree: Tree, children: str, root_B: jax.Array, sampling: SamplingParams, key: jax.Array, grower: Grower,
                 carry: Any, plan: RoundPlan) -> tuple[Any, Drawn]:
  """(carry, (tokens [B, N], distributions [B, N, W] or None)) of a round's static tree (`grow_tree`: its
  cut at the plan's depth), or only that cut's spine where the plan says so (`spine_or_whole`): what the
  model and EAGLE drafters both draw, each feeding its levels its own way (`grower`)."""
  def draw(shape: Tree, carry: Any) -> tuple[Any, Drawn]:
    tokens_BxN, probs_BxNxW, carry = grow_tree(shape, children, root_B, sampling, key, grower, carry, plan)
    return carry, (tokens_BxN, probs_BxNxW)

  return spine_or_whole(tree, plan.spine, draw, carry)
