"""Constraints on device: each row's DFA state, the mask it puts on logits, and how it advances.

`SamplingParams.constraint` holds one of two objects answering the same questions. `Unconstrained` is
the null one: it masks nothing, forces nothing, keeps no state and has no arrays. `Constrained` holds
the token table of the batch's constraints (`compiler.stack`: one [Z, V] table, each row starting at
its own constraint's start state), the token each state forces (jump-forward: a state allowing a
single token, `forced`), and a state per row, or per row and verified position or tree node (`along`).

State -1 is "dead": the path went through a token the constraint does not allow. Only draft tokens can
lead there (every committed token is allowed), and the rule rejects such a token, so nothing after it is
ever committed: a dead state masks nothing, which keeps those positions' distributions finite.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

DEAD = -1


@flax.struct.dataclass
class Unconstrained:
  """No constraint (the null object): every method is the identity."""
  def mask(self, logits_xV: jax.Array) -> jax.Array:
    return logits_xV

  def along(self, tokens_BxN: jax.Array, tree: Any = None) -> Unconstrained:
    return self

  def at(self, nodes_xL: Any) -> Unconstrained:
    return self

  def after(self, tokens_BxT: jax.Array, counts_B: jax.Array | int) -> Unconstrained:
    return self

  def cut(self, proposal: Any) -> Any:
    return proposal

  def force(self, proposal: Any) -> Any:
    return proposal

  def forced_count(self, tokens_BxT: jax.Array, counts_B: jax.Array) -> jax.Array:
    return jnp.zeros(tokens_BxT.shape[:1], jnp.int32)


@flax.struct.dataclass
class Constrained(Unconstrained):
  """The rows' constraints (one table, `compiler.stack`) and where each row (or verified position) is."""

  next_ZxV: jax.Array  # int32 [Z, V]: the state after each token, -1 = not allowed (`compiler.TokenTable`)
  forced_Z: jax.Array  # int32 [Z]: the one token each state allows, -1 where it allows several (`forced_tokens`)
  state: jax.Array  # int32 [B] (or [B, T]: one per verified position, `along`); -1 = dead (masks nothing)

  def allowed(self) -> jax.Array:
    """bool [..., V] (the state's shape + V): the tokens each state allows (all of them when dead)."""
    return (self.next_ZxV[jnp.maximum(self.state, 0)] >= 0) | (self.state == DEAD)[..., None]

  def forced(self) -> jax.Array:
    """int32 (the state's shape): the one token each state allows, -1 where it allows several (or is
    dead). The constrained distribution there is a point mass on it whatever the model says: committing
    it needs no model (jump-forward). Only a single allowed *token* is forced: a forced byte string that
    several token sequences spell is the target's choice among them."""
    return jnp.where(self.state == DEAD, -1, self.forced_Z[jnp.maximum(self.state, 0)])

  def mask(self, logits_xV: jax.Array) -> jax.Array:
    """The logits with -inf on the tokens the state does not allow (logits' leading shape = the state's).
    Logits over W ids other than the table's V (a draft's padded head) are masked on the ids both span;
    ids past V are never allowed."""
    allowed_xV, width = self.allowed(), logits_xV.shape[-1]
    extra = [(0, 0)] * (allowed_xV.ndim - 1) + [(0, max(width - allowed_xV.shape[-1], 0))]
    return jnp.where(jnp.pad(allowed_xV, extra)[..., :width], logits_xV, -jnp.inf)

  def advance(self, tokens_x: jax.Array) -> jax.Array:
    """The state after one token each (int32, the state's shape): dead stays dead, and an id past the
    table's V (a draft's padded head) leads there."""
    vocab = self.next_ZxV.shape[1]
    next_x = self.next_ZxV[jnp.maximum(self.state, 0), jnp.clip(tokens_x, 0, vocab - 1)]
    return jnp.where((self.state == DEAD) | (tokens_x >= vocab), DEAD, next_x)

  def along(self, tokens_BxN: jax.Array, tree: Any = None) -> Constrained:
    """The states [B, N + 1] of the verified block [pending, x_1 .. x_N] (this one: the state after
    pending, at the root): x_i's state is its parent's advanced by x_i, so position i's distribution (of
    what follows x_i) is masked by it. `tree` (a `tree.Tree`, or one per row: `dynamic.DynamicTree`; only
    its `parent` [N + 1] or [B, N + 1] and `max_depth` are read) gives the parents; None = a chain
    (x_i's parent is x_{i-1}): one step per token; a tree: one pass over all nodes per level (after pass
    d every node of depth <= d is right)."""
    batch, nodes = tokens_BxN.shape
    if tree is None:
      states = [self.state]
      for i in range(nodes):
        states.append(self.replace(state=states[-1]).advance(tokens_BxN[:, i]))
      return self.replace(state=jnp.stack(states, axis=1))
    parent_BxN = jnp.broadcast_to(jnp.asarray(tree.parent, jnp.int32), (batch, nodes + 1))[:, 1:]
    root_Bx1 = self.state[:, None]
    states_BxN1 = jnp.broadcast_to(root_Bx1, (batch, nodes + 1))
    for _ in range(tree.max_depth):
      parents_BxN = self.replace(state=jnp.take_along_axis(states_BxN1, parent_BxN, axis=1))
      states_BxN1 = jnp.concatenate([root_Bx1, parents_BxN.advance(tokens_BxN)], axis=1)
    return self.replace(state=states_BxN1)

  def at(self, nodes_xL: Any) -> Constrained:
    """The states [B, L] of some positions of `along`'s [B, N + 1]: `nodes_xL` [L] (every row's) or [B, L]."""
    index_BxL = jnp.broadcast_to(jnp.asarray(nodes_xL, jnp.int32), (self.state.shape[0], jnp.shape(nodes_xL)[-1]))
    return self.replace(state=jnp.take_along_axis(self.state, index_BxL, axis=1))

  def after(self, tokens_BxT: jax.Array, counts_B: jax.Array | int) -> Constrained:
    """The state [B] after each row's first `counts_B` tokens of `tokens_BxT` (0: unchanged)."""
    counts_Bx1 = jnp.broadcast_to(jnp.asarray(counts_B, jnp.int32), self.state.shape)[:, None]
    return self.replace(state=self.along(tokens_BxT).at(counts_Bx1).state[:, 0])

  def cut(self, proposal: Any) -> Any:
    """A point-mass proposal cut at its first token the constraint does not allow (a lookup's proposal
    is a function of the history, so its length may depend on it); a tree's, at the deepest node whose
    whole path is allowed (its disallowed nodes stay: the masked target never accepts them). A sampled
    proposal is left whole: cutting it where a draw fails would change the distribution the rule's
    residual corrects; the target's mask rejects such a token instead."""
    if not proposal.point_masses:
      return proposal
    tree = proposal.verified_tree
    batch, nodes = proposal.tokens.shape
    depth_BxN = jnp.broadcast_to(
        jnp.arange(1, nodes + 1, dtype=jnp.int32) if tree is None else jnp.asarray(tree.depth, jnp.int32)[..., 1:],
        (batch, nodes))
    live_BxN = self.along(proposal.tokens, tree).state[:, 1:] != DEAD  # dead spreads to the descendants
    deepest_B = jnp.max(jnp.where(live_BxN, depth_BxN, 0), axis=1)
    return proposal.replace(lengths=jnp.minimum(proposal.lengths, deepest_B))

  def force(self, proposal: Any) -> Any:
    """A point-mass chain proposal (a lookup's) with each position whose state allows a single token
    holding that token (jump-forward: the masked target accepts it with certainty), proposed also past
    the lookup's end while the states keep forcing one: a function of the history, like the lookup. Up
    to K = `proposal.k` positions. A tree's proposal is left as it is."""
    if proposal.verified_tree is not None:
      return proposal
    at, tokens, covered_B, length_B = self, [], jnp.ones(self.state.shape, bool), jnp.zeros(self.state.shape, jnp.int32)
    for i in range(proposal.k):
      forced_B = at.forced()
      tokens.append(jnp.where(forced_B >= 0, forced_B, proposal.tokens[:, i]))
      covered_B &= (forced_B >= 0) | (i < proposal.lengths)
      length_B += covered_B
      at = at.replace(state=at.advance(tokens[-1]))
    return proposal.replace(tokens=jnp.stack(tokens, axis=1), lengths=length_B)

  def forced_count(self, tokens_BxT: jax.Array, counts_B: jax.Array) -> jax.Array:
    """[B] int32: how many of each row's first `counts_B` tokens of `tokens_BxT` were forced (their
    state allowed only them: `forced`), the jump-forward tokens the stats count."""
    forced_BxT = self.along(tokens_BxT).forced()[:, :-1] >= 0
    return jnp.sum(forced_BxT & (jnp.arange(tokens_BxT.shape[1])[None, :] < counts_B[:, None]), axis=1, dtype=jnp.int32)


def forced_tokens(next_ZxV: Any) -> np.ndarray:
  """int32 [Z]: the one token each state of a table allows, -1 where it allows several. Derived on the
  host with numpy, once per table (faster there than XLA CPU's reductions over a large table)."""
  allowed_ZxV = np.asarray(next_ZxV) >= 0
  return np.where(allowed_ZxV.sum(axis=1) == 1, allowed_ZxV.argmax(axis=1), -1).astype(np.int32)


def constrained(next_ZxV: Any, start_B: Any, forced_Z: Any = None) -> Constrained:
  """A constraint on device: a stacked table (`compiler.stack`), each row's start state and the table's
  forced tokens (`forced_tokens`, derived here unless given: once per table, not per round)."""
  forced_Z = forced_tokens(next_ZxV) if forced_Z is None else forced_Z
  return Constrained(next_ZxV=jnp.asarray(next_ZxV, jnp.int32), forced_Z=jnp.asarray(forced_Z, jnp.int32),
                     state=jnp.asarray(start_B, jnp.int32))
