"""What a drafter hands the verifier: K draft tokens per row, how many of them are real, and either the
distributions they were drawn from or nothing (point masses: deterministic drafters, and every drafter
when decoding greedily, whose tokens are argmaxes).

A tree proposal (`tree` or `dynamic_tree` set) holds the N nodes of a draft tree instead of a chain; once verified,
`along` turns it into the chain of its accepted path, which the loop and drafters commit like any chain.

A point-mass proposal never materialises `[B, K, V]`: prompt lookup over a 152k vocabulary would
otherwise build a one-hot tensor of K x 152k floats per row and round.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Proposal:
  tokens: jax.Array  # [B, K] int32 draft tokens d_1 .. d_K (slots past `lengths` hold anything)
  lengths: jax.Array  # [B] int32 in [0, K]: leading tokens actually proposed; later slots are never accepted
  probs: jax.Array | None = None  # [B, K, W] float32 distributions each d_i was drawn from, over the drafter's
  #                                 W ids (the target's V, or another size: `acceptance` extends with zeros);
  #                                 None = point masses
  calls: jax.Array | int = 0  # [] int32: draft forward passes this proposal cost (0 for a lookup), for metrics
  # Static: a `tree.Tree` when the K = N tokens are the nodes 1..N of a draft tree (probs[:, i] = what
  # node i + 1 was drawn from, see `tree_acceptance`); None for a chain.
  tree: Any = flax.struct.field(pytree_node=False, default=None)
  dynamic_tree: Any = None  # a `dynamic_tree.DynamicTree` (arrays: one tree per row) instead of a static tree
  path: jax.Array | None = None  # [B, Dt + 1] int32: the accepted tree path (node indices), set by `along`

  @property
  def k(self) -> int:
    return self.tokens.shape[1]

  @property
  def verified_tree(self) -> Any:
    """The tree the K = N tokens are the nodes of, which the verifier scores (static `tree` or per-row
    `dynamic_tree`), or None for a chain."""
    return self.tree if self.dynamic_tree is None else self.dynamic_tree

  @property
  def point_masses(self) -> bool:
    return self.probs is None

  def along(self, path_BxDt1: jax.Array) -> "Proposal":
    """The chain of a tree proposal's tokens along each row's accepted path (root excluded): Dt tokens,
    as many proposed as the tree's longest proposed branch (`lengths`, at most Dt), `path` kept for drafters that
    compact their own cache (point masses: the chain is only read for its tokens)."""
    tokens_BxN1 = jnp.pad(self.tokens, ((0, 0), (1, 0)))
    tokens_BxDt = jnp.take_along_axis(tokens_BxN1, path_BxDt1[:, 1:], axis=1)
    return Proposal(tokens=tokens_BxDt, lengths=jnp.minimum(self.lengths, tokens_BxDt.shape[1]), calls=self.calls,
                    path=path_BxDt1)

  def picked(self, nodes: Any) -> "Proposal":
    """The nodes `nodes` (static indices >= 1, in order) of a tree proposal as a proposal of their own,
    e.g. a chain of them (a tree's spine: `Tree.spine`); `tree` is kept, the verifier is given the
    smaller tree."""
    slots = [node - 1 for node in nodes]
    return self.replace(tokens=self.tokens[:, slots], lengths=jnp.minimum(self.lengths, len(slots)),
                        probs=None if self.probs is None else self.probs[:, slots])

  def truncated(self, width: int) -> "Proposal":
    """The first `width` slots (static): what a verify pass of `width` + 1 tokens can check."""
    return self.replace(tokens=self.tokens[:, :width], lengths=jnp.minimum(self.lengths, width),
                        probs=None if self.probs is None else self.probs[:, :width])


def full(tokens_BxK: jax.Array, probs_BxKxV: jax.Array | None = None, calls: int = 0) -> Proposal:
  """A proposal of all K tokens in every row, made with `calls` draft forward passes."""
  batch, k = tokens_BxK.shape
  return Proposal(tokens=tokens_BxK, lengths=jnp.full((batch,), k, jnp.int32), probs=probs_BxKxV,
                  calls=jnp.int32(calls))
