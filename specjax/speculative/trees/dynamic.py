"""Dynamic draft trees (EAGLE-2): each row's tree is chosen every round by the draft's own confidence,
under a static node budget, so every shape stays static.

`DynamicSpec(nodes=N, depth=Dt, expand=b)` (config `tree = "dynamic(N, D, b)"`, D = Dt):
- the root's b most likely children are the first candidates (depth 1);
- at each depth d < Dt the frontier, the b candidates of depth d with the highest cumulative draft
  log-probability (all b at depth 1), is fed to the draft in one chunk (each node attending to the
  committed cache and its fed ancestors), and each frontier node's b most likely children become
  candidates: b + (Dt - 1) b^2 candidates in all;
- the tree is the N candidates of highest cumulative log-probability, ties to the earlier candidate.
  A node's score never exceeds its parent's and its parent was created earlier, so every chosen
  node's parent is chosen: the N nodes form a tree. They are numbered in creation order: level by
  level (a node after its parent), siblings contiguous and by rank, which is all `tree_acceptance`
  and `KVCache.compact` need of `tree.Tree`'s numbering.

Children are point masses: the b most likely tokens of the draft's distribution (after temperature,
top-k and top-p; of its logits when greedy), masked by a constraint's state at the expanded node (its
path's: `Constrained.along`). Which tokens the tree holds depends on the draft alone,
so `tree_acceptance`'s rule with `probs = None` keeps the output exactly the target's.

`DynamicTree` holds one tree per row (parents and depths [B, N + 1], arrays); the tables attention and
`tree_acceptance` read are derived in the program (ancestors by Dt parent hops).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Params, forward_hidden
from specjax.sampling import SamplingParams, probabilities
from specjax.speculative.drafters.draft_head import DraftHead, draft_inputs, draft_logits


@dataclasses.dataclass(frozen=True)
class DynamicSpec:
  """The static budget of a dynamic tree: N draft nodes, depth Dt, b children per expanded node."""

  nodes: int
  depth: int
  expand: int

  def __post_init__(self):
    for name in ("nodes", "depth", "expand"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"tree: dynamic {name} must be an integer >= 1, got {value!r}")
    if self.nodes > self.candidates:
      raise ValueError(f"tree: dynamic({self.nodes}, {self.depth}, {self.expand}) keeps {self.nodes} nodes "
                       f"of only {self.candidates} candidates (b + (D - 1) b^2): lower the nodes or raise "
                       f"the depth or expansion")

  @property
  def candidates(self) -> int:
    return self.expand + (self.depth - 1) * self.expand**2

  @property
  def nodes_with_root(self) -> int:
    """N + 1: the root and the N draft nodes (the verify chunk's width)."""
    return self.nodes + 1

  @property
  def max_depth(self) -> int:
    return self.depth

  @property
  def draft_slots(self) -> int:
    """Cache slots a proposal writes beyond the committed history: the root and (Dt - 1) b frontier nodes."""
    return 1 + (self.depth - 1) * self.expand

  is_chain = False

  def check_fits(self, cache_len: int, name: str = "cache") -> None:
    """Raises ValueError unless a cache of `cache_len` positions holds a round's chunks."""
    need = max(self.nodes_with_root, self.draft_slots)
    if need > cache_len:
      raise ValueError(f"a dynamic tree of {self.nodes} nodes (depth {self.depth}, expansion {self.expand}) "
                       f"needs {need} free positions per round, the {name} holds {cache_len}")


def _hops(parent_BxN1: jax.Array, depth: int) -> jax.Array:
  """[B, N + 1, Dt + 1]: entry s of node i is its ancestor s generations up (the root beyond it)."""
  parent_BxN1 = jnp.maximum(parent_BxN1, 0)  # the root's parent: itself
  hops = [jnp.broadcast_to(jnp.arange(parent_BxN1.shape[1], dtype=jnp.int32), parent_BxN1.shape)]
  for _ in range(depth):
    hops.append(jnp.take_along_axis(parent_BxN1, hops[-1], axis=1))
  return jnp.stack(hops, axis=-1)


@flax.struct.dataclass
class DynamicTree:
  """One tree per row, numbered like `tree.Tree` (parent[b, i] < i, depths non-decreasing)."""

  parent: jax.Array  # [B, N + 1] int32: parent[:, 0] = -1
  depth: jax.Array  # [B, N + 1] int32: depth[:, 0] = 0
  max_depth: int = flax.struct.field(pytree_node=False)  # Dt: the deepest a node may be
  max_children: int = flax.struct.field(pytree_node=False)  # b: the most children a node may have

  first = 0  # as a verify chunk, the whole tree (see `tree.TreeLevel`)
  is_chain = False

  @property
  def nodes_with_root(self) -> int:
    return self.parent.shape[1]

  @property
  def key_depth(self) -> jax.Array:
    return self.depth

  def ancestor_mask(self) -> jax.Array:
    """[B, N + 1, N + 1] bool: mask[b, i, j] when node j is node i or one of its ancestors."""
    hops_BxN1xDt1 = _hops(self.parent, self.max_depth)
    return jnp.any(hops_BxN1xDt1[..., None] == jnp.arange(self.nodes_with_root)[None, None, None, :], axis=2)

  def path_table(self) -> jax.Array:
    """[B, N + 1, Dt + 1] int32: node i's root-to-node path, padded with i beyond its depth."""
    hops_BxN1xDt1 = _hops(self.parent, self.max_depth)
    up_BxN1xDt1 = self.depth[..., None] - jnp.arange(self.max_depth + 1)[None, None, :]  # hops from i to depth j
    along_BxN1xDt1 = jnp.take_along_axis(hops_BxN1xDt1, jnp.clip(up_BxN1xDt1, 0, self.max_depth), axis=2)
    own_BxN1 = jnp.broadcast_to(jnp.arange(self.nodes_with_root, dtype=jnp.int32), self.parent.shape)
    return jnp.where(up_BxN1xDt1 >= 0, along_BxN1xDt1, own_BxN1[..., None])

  def children_table(self) -> jax.Array:
    """[B, N + 1, C] int32: each node's children in rank (= index) order, padded with -1; C = b."""
    nodes = jnp.arange(self.nodes_with_root, dtype=jnp.int32)
    is_child_BxN1xN1 = self.parent[:, None, :] == nodes[None, :, None]  # [b, i, j]: j is a child of i
    order_BxN1xN1 = jnp.argsort(jnp.where(is_child_BxN1xN1, nodes, self.nodes_with_root), axis=-1, stable=True)
    children_BxN1xC = order_BxN1xN1[..., :self.max_children].astype(jnp.int32)
    return jnp.where(jnp.take_along_axis(is_child_BxN1xN1, children_BxN1xC, axis=-1), children_BxN1xC, -1)


@dataclasses.dataclass(frozen=True)
class _Frontier:
  """One frontier chunk as the model API reads a tree chunk: `count` nodes written after the `first`
  fed before (one depth per chunk), each attending to its fed ancestors (`mask`, per row)."""

  first: int
  count: int
  mask: jax.Array  # [B, count, first + count] bool

  @property
  def depth(self) -> tuple[int, ...]:  # positions past the root (the cache's last committed token)
    return (self.first // self.count,) * self.count

  @property
  def key_depth(self) -> tuple[int, ...]:
    return tuple(slot // self.count for slot in range(self.first + self.count))

  def ancestor_mask(self) -> jax.Array:
    return self.mask


def _children(logits_BxLvxW: jax.Array, sampling: SamplingParams, expand: int) -> tuple[jax.Array, jax.Array]:
  """The `expand` most likely tokens [B, Lv, b] of each distribution and their log-probabilities (under
  `sampling`'s constraint: its states [B, Lv])."""
  if sampling.greedy:
    logp_BxLvxW = jax.nn.log_softmax(sampling.constraint.mask(logits_BxLvxW), axis=-1)
  else:
    logp_BxLvxW = jnp.log(probabilities(logits_BxLvxW, sampling))
  logp_BxLvxb, tokens_BxLvxb = jax.lax.top_k(logp_BxLvxW, expand)
  return tokens_BxLvxb.astype(jnp.int32), jnp.maximum(logp_BxLvxb, -1e30)  # finite: ordered, never NaN


def _best(scores_BxC: jax.Array, count: int) -> jax.Array:
  """Indices [B, count] of the `count` highest scores, ties to the lower index."""
  return jnp.argsort(-scores_BxC, axis=-1, stable=True)[:, :count].astype(jnp.int32)


@dataclasses.dataclass
class _Growth:
  """The candidates grown so far, in creation order, as one block per depth ([B, b] at depth 1, [B, b^2]
  deeper; a candidate's parent is a node index: 0 the root, c + 1 candidate c), and the next frontier."""

  spec: DynamicSpec
  sampling: SamplingParams  # its constraint's state is the root's
  tokens: list[jax.Array]
  scores: list[jax.Array]  # cumulative draft log-probabilities
  parents: list[jax.Array]
  depths: list[jax.Array]
  slots: list[jax.Array]  # each candidate's fed slot, -1 until fed
  fed_mask: jax.Array  # [B, C_d, Fr]: each candidate of the newest depth's fed ancestors
  frontier_Bxb: jax.Array  # candidate indices of the next frontier

  @classmethod
  def start(cls, spec: DynamicSpec, root_logits_BxW: jax.Array, sampling: SamplingParams) -> _Growth:
    """The root's b most likely children: the depth-1 candidates, all of them the first frontier."""
    b, batch = spec.expand, root_logits_BxW.shape[0]
    root = sampling.constraint.along(jnp.zeros((batch, 0), jnp.int32))
    tokens_Bxb, scores_Bxb = (
        x[:, 0] for x in _children(root_logits_BxW[:, None], sampling.replace(constraint=root), b))
    return cls(spec, sampling, [tokens_Bxb], [scores_Bxb], [jnp.zeros((batch, b), jnp.int32)],
               [jnp.ones((batch, b), jnp.int32)], [jnp.full((batch, b), -1, jnp.int32)],
               jnp.zeros((batch, b, (spec.depth - 1) * b), bool),
               jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32), (batch, b)))

  @property
  def created(self) -> int:
    return sum(block.shape[1] for block in self.tokens)

  def _gather(self, blocks: list[jax.Array], index_BxI: jax.Array) -> jax.Array:
    return jnp.take_along_axis(jnp.concatenate(blocks, 1), index_BxI, axis=1)

  def feed(self, d: int, score_frontier: Callable, carry: Any) -> tuple[jax.Array, jax.Array, Any]:
    """Feeds the frontier (of depth d) as one chunk at slots (d - 1) b .. d b - 1 and records those slots.
    Returns its logits [B, b, W], its nodes' fed-ancestor masks [B, b, Fr] and the new carry."""
    b, Dt, batch = self.spec.expand, self.spec.depth, self.frontier_Bxb.shape[0]
    first = (d - 1) * b
    local_Bxb = self.frontier_Bxb - (self.created - self.tokens[-1].shape[1])  # within the newest depth
    own_BxbxFr = jax.nn.one_hot(first + jnp.arange(b), (Dt - 1) * b, dtype=bool)[None]
    mask_BxbxFr = jnp.take_along_axis(self.fed_mask, local_Bxb[:, :, None], axis=1) | own_BxbxFr
    chunk_Bxb = self._gather(self.tokens, self.frontier_Bxb)
    parent_Bxb = self._gather(self.parents, self.frontier_Bxb)  # node index, 0 = root
    parent_slots_Bxb = jnp.where(
        parent_Bxb > 0, jnp.take_along_axis(jnp.concatenate(self.slots, 1), jnp.maximum(parent_Bxb - 1, 0), axis=1), -1)
    logits_BxbxW, carry = score_frontier(carry, chunk_Bxb, _Frontier(first, b, mask_BxbxFr[:, :, :first + b]),
                                         parent_slots_Bxb)
    self.slots[-1] = self.slots[-1].at[jnp.arange(batch)[:, None],
                                       local_Bxb].set(first + jnp.arange(b, dtype=jnp.int32)[None])
    return logits_BxbxW, mask_BxbxFr, carry

  def expand(self, d: int, logits_BxbxW: jax.Array, mask_BxbxFr: jax.Array) -> None:
    """Adds each frontier node's b most likely children (masked by the node's own constraint state) as the
    depth d + 1 candidates, and picks the next frontier: the b of them with the highest scores."""
    b, batch = self.spec.expand, self.frontier_Bxb.shape[0]
    created = self.created
    candidates = DynamicTree(parent=jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32)] + self.parents, 1),
                             depth=jnp.concatenate([jnp.zeros((batch, 1), jnp.int32)] + self.depths,
                                                   1), max_depth=d, max_children=b)
    constraint = self.sampling.constraint.along(jnp.concatenate(self.tokens, 1), candidates)
    child_tokens_Bxbxb, child_logp_Bxbxb = _children(
        logits_BxbxW, self.sampling.replace(constraint=constraint.at(self.frontier_Bxb + 1)), b)
    frontier_scores_Bxb = self._gather(self.scores, self.frontier_Bxb)
    self.tokens.append(child_tokens_Bxbxb.reshape(batch, b * b))
    self.scores.append((frontier_scores_Bxb[:, :, None] + child_logp_Bxbxb).reshape(batch, b * b))
    self.parents.append(jnp.repeat(self.frontier_Bxb + 1, b, axis=1))
    self.depths.append(jnp.full((batch, b * b), d + 1, jnp.int32))
    self.slots.append(jnp.full((batch, b * b), -1, jnp.int32))
    self.fed_mask = jnp.repeat(mask_BxbxFr, b, axis=1)
    self.frontier_Bxb = created + _best(self.scores[-1], b)

  def chosen(self) -> tuple[jax.Array, DynamicTree, jax.Array]:
    """The N best candidates, renumbered in creation order (node = rank among the chosen + 1): their tokens
    [B, N], the trees and each node's fed slot [B, N + 1] (-1: the root and unfed nodes)."""
    nodes, batch = self.spec.nodes, self.frontier_Bxb.shape[0]
    chosen_BxN = jnp.sort(_best(jnp.concatenate(self.scores, 1), nodes), axis=-1)
    node_of_BxC = jnp.zeros((batch, self.created),
                            jnp.int32).at[jnp.arange(batch)[:, None],
                                          chosen_BxN].set(jnp.arange(1, nodes + 1, dtype=jnp.int32)[None])
    parent_candidate_BxN = self._gather(self.parents, chosen_BxN)
    parent_BxN = jnp.where(parent_candidate_BxN > 0,
                           jnp.take_along_axis(node_of_BxC, jnp.maximum(parent_candidate_BxN - 1, 0), axis=1), 0)
    root = lambda value: jnp.full((batch, 1), value, jnp.int32)
    tree = DynamicTree(parent=jnp.concatenate([root(-1), parent_BxN], 1),
                       depth=jnp.concatenate([root(0), self._gather(self.depths, chosen_BxN)],
                                             1), max_depth=self.spec.depth, max_children=self.spec.expand)
    return (self._gather(self.tokens,
                         chosen_BxN), tree, jnp.concatenate([root(-1), self._gather(self.slots, chosen_BxN)], 1))


def grow_dynamic_tree(spec: DynamicSpec, root_logits_BxW: jax.Array, sampling: SamplingParams, score_frontier: Callable,
                      carry: Any) -> tuple[jax.Array, DynamicTree, jax.Array, Any]:
  """Grows each row's tree from its root's logits `root_logits_BxW` (see the module docstring), a
  drafter's passes given by `score_frontier(carry, tokens_Bxb, frontier, parent_slots_Bxb)`: it feeds one
  frontier chunk (a `_Frontier`: slots `first` .. `first + b - 1` beyond what the drafter holds, each
  node attending to its fed ancestors) whose nodes' parents were fed at `parent_slots_Bxb` (-1: the
  root), and returns the chunk's logits [B, b, W] and the new carry. Under a constraint (`sampling`'s,
  its state at the root) each node's children are drawn from its logits masked by the node's own state
  (`Constrained.along` over the candidates so far).

  Returns the tokens [B, N] of nodes 1..N, the trees, each node's fed slot [B, N + 1] (-1 for nodes
  never fed: the root, which is history, and unexpanded ones) and the last carry.
  """
  growth = _Growth.start(spec, root_logits_BxW, sampling)
  for d in range(1, spec.depth):
    logits_BxbxW, mask_BxbxFr, carry = growth.feed(d, score_frontier, carry)
    growth.expand(d, logits_BxbxW, mask_BxbxFr)
  return *growth.chosen(), carry


def draft_dynamic_tree(config: ModelConfig, params: Params, head: DraftHead | None, spec: DynamicSpec, cache: KVCache,
                       root_logits_BxW: jax.Array,
                       sampling: SamplingParams) -> tuple[jax.Array, DynamicTree, jax.Array, KVCache]:
  """Grows each row's tree with a draft model after its history and root (already in `cache`, whose
  logits after the root are `root_logits_BxW`): `grow_dynamic_tree`, each frontier chunk one
  tree-masked draft pass written beyond each row's length (not advanced). Returns its tokens, trees and
  slots, and the cache."""
  def score_frontier(cache, chunk_Bxb, frontier, parent_slots_Bxb):
    hidden_BxbxD, cache = forward_hidden(config, params, draft_inputs(config, head, chunk_Bxb), cache, tree=frontier)
    return draft_logits(config, params, head, hidden_BxbxD), cache

  return grow_dynamic_tree(spec, root_logits_BxW, sampling, score_frontier, cache)
