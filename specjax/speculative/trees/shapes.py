"""What a round drafts, as a strategy: a chain of K tokens, a static tree (`tree.Tree`) or a dynamic one
(`dynamic.DynamicSpec`, one tree per row drawn each round). `of` is the one place that tells them apart;
the K policy, the loop, the pipeline and the drafters ask the shape, never its type.

A drafter with its own cache (`ModelBackedDrafter`: the model and EAGLE drafters) drafts and commits
through its shape (`Shape.propose`, `Shape.commit`), which calls the drafter's hook for that shape:
`propose_chain` / `propose_static` / `propose_dynamic` and `commit_chain` / `commit_static` /
`commit_dynamic` (the tree hooks default to the chain's commit).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.speculative.trees.dynamic import DynamicSpec
from specjax.speculative.trees.tree import Tree


@dataclasses.dataclass(frozen=True)
class Chain:
  """K draft tokens in a row (`config.tree` empty)."""

  tree: Any = None  # the drafter's `tree` setting: None for a chain
  drawn_each_round = False  # the shape is drawn by each round's draft (the adaptive policy cannot cut it)

  @property
  def spines(self) -> bool:
    """Whether an adaptive round may verify only a cut's spine (a static tree that branches)."""
    return False

  def spine_depth(self, depth: int) -> int:
    """The tokens of the first-choice path of the cut at `depth` (`Tree.spine`)."""
    return depth

  def branches_within(self, depth: int) -> bool:
    """Whether the cut at `depth` branches (its spine verifies fewer nodes)."""
    return False

  def cut_nodes(self, depth: int) -> int:
    """The tokens a verify pass of the cut at `depth` scores, the pending one included."""
    return depth + 1

  def lookahead(self, k: int) -> int:
    """Cache slots a round writes beyond the committed history, as a verify chunk or a draft (at least K)."""
    return k

  def propose(self, drafter: Any, state: Any, pending_B: Any, sampling: Any, key: Any, plan: Any) -> tuple[Any, Any]:
    """(the proposal, the drafter's state) of `drafter`'s hook for this shape."""
    return drafter.propose_chain(state, pending_B, sampling, key, plan)

  def commit(self, drafter: Any, state: Any, proposal: Any, num_committed_B: Any, features: Any) -> Any:
    """The drafter's state after a round committed `num_committed_B` tokens of `proposal` (a tree's:
    its accepted path, `Proposal.along`), by its hook for this shape."""
    return drafter.commit_chain(state, proposal, num_committed_B, features)


@dataclasses.dataclass(frozen=True)
class Static(Chain):
  """A static tree: every row drafts the same shape (its cut at the policy's depth, or that cut's spine)."""

  tree: Tree = None

  @property
  def spines(self) -> bool:
    return not self.tree.is_chain

  def spine_depth(self, depth: int) -> int:
    return len(self.tree.spine(depth)) - 1

  def branches_within(self, depth: int) -> bool:
    return not self.tree.cut(depth).is_chain

  def cut_nodes(self, depth: int) -> int:
    return self.tree.cut(depth).nodes_with_root

  def lookahead(self, k: int) -> int:
    return max(k, self.tree.nodes_with_root - 1)

  def propose(self, drafter: Any, state: Any, pending_B: Any, sampling: Any, key: Any, plan: Any) -> tuple[Any, Any]:
    return drafter.propose_static(state, pending_B, sampling, key, plan)

  def commit(self, drafter: Any, state: Any, proposal: Any, num_committed_B: Any, features: Any) -> Any:
    return drafter.commit_static(state, proposal, num_committed_B, features)


@dataclasses.dataclass(frozen=True)
class Dynamic(Chain):
  """A dynamic tree: each row's own tree, grown every round under a static node budget."""

  tree: DynamicSpec = None
  drawn_each_round = True

  def cut_nodes(self, depth: int) -> int:
    return self.tree.nodes_with_root

  def lookahead(self, k: int) -> int:
    return max(k, self.tree.nodes_with_root - 1, self.tree.draft_slots)

  def propose(self, drafter: Any, state: Any, pending_B: Any, sampling: Any, key: Any, plan: Any) -> tuple[Any, Any]:
    return drafter.propose_dynamic(state, pending_B, sampling, key, plan)

  def commit(self, drafter: Any, state: Any, proposal: Any, num_committed_B: Any, features: Any) -> Any:
    return drafter.commit_dynamic(state, proposal, num_committed_B, features)


def of(tree: Tree | DynamicSpec | None) -> Chain:
  """The shape a drafter's `tree` setting drafts (None: a chain)."""
  if tree is None:
    return Chain()
  if isinstance(tree, DynamicSpec):
    return Dynamic(tree)
  if isinstance(tree, Tree):
    return Static(tree)
  raise ValueError(f"a drafter's tree must be a static Tree or a DynamicSpec, got {tree!r}")
