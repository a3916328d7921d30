"""Static draft trees: the shape of a tree proposal, fixed at compile time.

Node 0 is the root (the pending token, already chosen); nodes 1..N are draft tokens. Nodes are numbered
level by level (every node of depth d before any node of depth d + 1) and, within a level, in the order
of their parents, then of their rank among siblings: parents come before children, a node's children are
contiguous and ordered by rank (child 0 = the draft's first choice). A chain of K tokens is the tree
`from_branching((1,) * K)`.

A verify pass feeds the N + 1 nodes as one chunk: node i sits at RoPE position `length + depth[i]`, is
written to cache slot `length + i` and attends to the committed cache and to its ancestors (itself
included): `ancestor_mask()`. A draft model may feed the tree one level at a time (`Tree.level`). The
model API reads `first`, `depth`, `key_depth` and `ancestor_mask()` only.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from typing import Sequence

import numpy as np

from specjax.speculative.trees.dynamic import DynamicSpec


@dataclasses.dataclass(frozen=True)
class Tree:
  """A static tree: hashable, so it can be a static argument of `jax.jit`."""

  parent: tuple[int, ...]  # [N + 1]: parent[0] = -1, parent[i] < i
  depth: tuple[int, ...]  # [N + 1]: depth[0] = 0, depth[i] = depth[parent[i]] + 1, non-decreasing

  def __str__(self) -> str:
    """The config string that names it (`parse`): its branching tuple where it is a full tree, e.g.
    (2, 2, 1), else its path list."""
    paths = [()]
    for node in range(1, len(self.parent)):
      rank = sum(1 for other in range(1, node) if self.parent[other] == self.parent[node])
      paths.append(paths[self.parent[node]] + (rank,))
    branching, node = [], 0
    while self.children(node):
      branching.append(len(self.children(node)))
      node = self.children(node)[0]
    if from_branching(branching) == self:
      return str(tuple(branching))
    return str([list(path) for path in paths[1:]])

  @property
  def nodes_with_root(self) -> int:
    """N + 1: the root and the N draft nodes (the verify chunk's width)."""
    return len(self.parent)

  @property
  def max_depth(self) -> int:
    """Dt: the most draft tokens one round can accept."""
    return max(self.depth)

  @property
  def first(self) -> int:
    """As a verify chunk, the whole tree: its first node is the root (see `TreeLevel`)."""
    return 0

  @property
  def key_depth(self) -> tuple[int, ...]:
    """The depths of the chunk slots a pass of the whole tree attends to: every node's."""
    return self.depth

  @property
  def draft_slots(self) -> int:
    """Cache slots a draft model's proposal writes beyond the committed history: every node."""
    return self.nodes_with_root

  @property
  def is_chain(self) -> bool:
    return self.parent == tuple(range(-1, self.nodes_with_root - 1))

  def children(self, node: int) -> tuple[int, ...]:
    """The children of `node`, in rank order."""
    return tuple(i for i, p in enumerate(self.parent) if p == node)

  @functools.cached_property
  def _ancestors(self) -> np.ndarray:
    mask = np.eye(self.nodes_with_root, dtype=bool)
    for i in range(1, self.nodes_with_root):
      mask[i] |= mask[self.parent[i]]
    return mask

  def ancestor_mask(self) -> np.ndarray:
    """[N + 1, N + 1] bool: mask[i, j] when node j is node i or one of its ancestors."""
    return self._ancestors.copy()

  def path_table(self) -> np.ndarray:
    """[N + 1, Dt + 1] int32: row i lists node i's root-to-node path (entry j = its ancestor at depth j),
    padded with i itself beyond its depth."""
    table = np.zeros((self.nodes_with_root, self.max_depth + 1), np.int32)
    for i in range(self.nodes_with_root):
      ancestors = np.flatnonzero(self._ancestors[i])  # ascending index = ascending depth
      table[i, :len(ancestors)] = ancestors
      table[i, len(ancestors):] = i
    return table

  def children_table(self) -> np.ndarray:
    """[N + 1, C] int32: the children of each node in rank order, padded with -1 (C = the largest
    number of children, at least 1)."""
    width = max(max(len(self.children(i)) for i in range(self.nodes_with_root)), 1)
    table = np.full((self.nodes_with_root, width), -1, np.int32)
    for i in range(self.nodes_with_root):
      kids = self.children(i)
      table[i, :len(kids)] = kids
    return table

  def cut(self, depth: int) -> "Tree":
    """The tree of the nodes no deeper than `depth`: a prefix of the nodes (numbered level by level), so
    every node keeps its index (what an adaptive round verifies of a deeper draft: `k_policy`)."""
    count = sum(1 for d in self.depth if d <= depth)
    return Tree(self.parent[:count], self.depth[:count])

  def spine(self, depth: int | None = None) -> tuple[int, ...]:
    """The nodes of the first-choice path, root first: each node's rank-0 child down to a leaf (or to
    `depth`). Verified alone it is a chain (what an adaptive round verifies when the tree's other
    branches do not pay: `k_policy.Candidate.spine`)."""
    nodes = [0]
    while (depth is None or len(nodes) <= depth) and self.children(nodes[-1]):
      nodes.append(self.children(nodes[-1])[0])
    return tuple(nodes)

  @property
  def is_first_child(self) -> tuple[bool, ...]:
    """[N + 1]: whether each node is the rank-0 child of its parent (the root counts as one)."""
    return tuple(i == 0 or self.children(self.parent[i])[0] == i for i in range(self.nodes_with_root))

  def level(self, depth: int) -> "TreeLevel":
    """The nodes of one depth as a chunk fed after the levels above it (drafting level by level)."""
    return TreeLevel(self, self.depth.index(depth), self.depth.count(depth))

  def check_fits(self, cache_len: int, name: str = "cache") -> None:
    """Raises ValueError unless a cache of `cache_len` positions can hold a verify chunk of this tree."""
    if self.nodes_with_root > cache_len:
      raise ValueError(f"a tree of {self.nodes_with_root - 1} nodes (depth {self.max_depth}) needs "
                       f"{self.nodes_with_root} free positions per round, the {name} holds {cache_len}")


@dataclasses.dataclass(frozen=True)
class TreeLevel:
  """The `count` nodes from `first` on (one depth level) as a chunk: written to slots `length + first ..`,
  attending to the committed cache and to their ancestors among the nodes 0 .. first + count - 1 (the
  earlier levels must already be written there, uncommitted). The model API reads `first`, `depth`,
  `key_depth` and `ancestor_mask()`, as for a whole `Tree`."""

  tree: Tree
  first: int
  count: int

  @property
  def depth(self) -> tuple[int, ...]:
    """The chunk's nodes' depths."""
    return self.tree.depth[self.first:self.first + self.count]

  @property
  def key_depth(self) -> tuple[int, ...]:
    """The depths of the nodes in the chunk slots it attends to: 0 .. first + count - 1."""
    return self.tree.depth[:self.first + self.count]

  def ancestor_mask(self) -> np.ndarray:
    """[count, first + count] bool: the rows of the chunk's nodes in the tree's ancestor mask."""
    return self.tree.ancestor_mask()[self.first:self.first + self.count, :self.first + self.count]


def _from_sorted_paths(paths: Sequence[tuple[int, ...]]) -> Tree:
  """The tree of complete, duplicate-free paths, numbered by (depth, path) order."""
  ordered = sorted(paths, key=lambda path: (len(path), path))
  index = {(): 0}
  parent, depth = [-1], [0]
  for path in ordered:
    index[path] = len(parent)
    parent.append(index[path[:-1]])
    depth.append(len(path))
  return Tree(parent=tuple(parent), depth=tuple(depth))


def from_paths(paths: Sequence[Sequence[int]]) -> Tree:
  """The tree of root-to-node paths in the Medusa/EAGLE "choices" format: each path lists the ranks of
  the children taken from the root, e.g. [[0], [1], [0, 0], [0, 1]] = two children of the root, the
  first with two children. Every prefix of a path must be a path too; ranks are >= 0 and, among the
  children of one node, contiguous from 0."""
  if not paths:
    raise ValueError("tree: the path list is empty (a tree needs at least one draft node)")
  seen = set()
  for raw in paths:
    path = tuple(raw)
    if not path:
      raise ValueError("tree: an empty path (the root is implicit; list draft nodes only)")
    if any(int(rank) != rank or rank < 0 for rank in path):
      raise ValueError(f"tree: path {list(path)} has a rank that is not an integer >= 0")
    if path in seen:
      raise ValueError(f"tree: path {list(path)} is listed twice")
    seen.add(path)
  for path in seen:
    if len(path) > 1 and path[:-1] not in seen:
      raise ValueError(f"tree: path {list(path)} lacks its prefix {list(path[:-1])}")
    if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in seen:
      raise ValueError(f"tree: path {list(path)} lacks its elder sibling {list(path[:-1] + (path[-1] - 1,))}")
  return _from_sorted_paths(list(seen))


def from_branching(branching: Sequence[int]) -> Tree:
  """The full tree with `branching[d]` children per node of depth d, e.g. (4, 2, 2, 1): 4 + 8 + 16 + 16
  draft nodes. (1,) * K is a chain of K."""
  if not branching:
    raise ValueError("tree: the branching tuple is empty (a tree needs at least one draft node)")
  if any(int(b) != b or b < 1 for b in branching):
    raise ValueError(f"tree: branching {tuple(branching)} must hold integers >= 1")
  level = [()]
  paths = []
  for width in branching:
    level = [path + (rank,) for path in level for rank in range(width)]
    paths += level
  return _from_sorted_paths(paths)


def parse(spec: str) -> Tree | DynamicSpec | None:
  """The tree a config string names: a branching tuple "(4, 2, 2, 1)", a path list "[[0], [1], [0, 0]]",
  a dynamic tree "dynamic(16, 6, 4)" (N nodes, depth D, b children per expanded node:
  `dynamic_tree`), or "" for none (a chain drafter). Raises ValueError naming the problem."""
  if not spec.strip():
    return None
  if spec.strip().startswith("dynamic"):
    try:
      budget = ast.literal_eval(spec.strip().removeprefix("dynamic"))
    except (ValueError, SyntaxError):
      budget = None
    if not (isinstance(budget, tuple) and len(budget) == 3):
      raise ValueError(f"tree {spec!r}: a dynamic tree is written dynamic(N, D, b): N nodes, depth D, "
                       f"b children per expanded node, e.g. dynamic(16, 6, 4)")
    return DynamicSpec(*budget)
  try:
    value = ast.literal_eval(spec.strip())
  except (ValueError, SyntaxError):
    raise ValueError(f"tree {spec!r} is neither a branching tuple like (4, 2, 2, 1) nor a path list like "
                     f"[[0], [1], [0, 0]]") from None
  if isinstance(value, int):
    value = (value,)
  if isinstance(value, tuple) and all(isinstance(b, int) for b in value):
    return from_branching(value)
  if isinstance(value, (list, tuple)) and all(isinstance(path, (list, tuple)) for path in value):
    return from_paths(value)
  raise ValueError(f"tree {spec!r} is neither a branching tuple like (4, 2, 2, 1) nor a path list like "
                   f"[[0], [1], [0, 0]]")


def chain(k: int) -> Tree:
  """K draft tokens in a row: the tree of plain speculative decoding."""
  return from_branching((1,) * k)
