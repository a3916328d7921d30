"""Constraints on device: each row's DFA state, the mask it puts on logits, and how it advances.

`SamplingParams.constraint` holds one of two objects answering the same questions. `Unconstrained` is
the null one: it masks nothing, keeps no state and has no arrays, so an unconstrained program is the
program it was before constraints existed. `Constrained` holds the token table of the batch's
constraints (`compiler.stack`: one [Z, V] table, each row starting at its own constraint's start
state) and a state per row, or per row and verified position (`along`).

State -1 is "dead": the path went through a token the constraint does not allow. Only draft tokens can
lead there (every committed token is allowed), and the rule rejects such a token, so nothing after it is
ever committed: a dead state masks nothing, which keeps those positions' distributions finite.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

DEAD = -1


@flax.struct.dataclass
class Unconstrained:
  """No constraint (the null object): every method is the identity."""

  def mask(self, logits_xV: jax.Array) -> jax.Array:
    return logits_xV

  def along(self, tokens_BxK: jax.Array) -> Unconstrained:
    return self

  def after(self, tokens_BxT: jax.Array, counts_B: jax.Array | int) -> Unconstrained:
    return self

  def cut(self, proposal: Any) -> Any:
    return proposal

  def check_drafter(self, drafter: Any) -> None:
    pass


@flax.struct.dataclass
class Constrained(Unconstrained):
  """The rows' constraints (one table, `compiler.stack`) and where each row (or verified position) is."""

  next_ZxV: jax.Array  # int32 [Z, V]: the state after each token, -1 = not allowed (`compiler.TokenTable`)
  state: jax.Array  # int32 [B] (or [B, T]: one per verified position, `along`); -1 = dead (masks nothing)

  def allowed(self) -> jax.Array:
    """bool [..., V] (the state's shape + V): the tokens each state allows (all of them when dead)."""
    return (self.next_ZxV[jnp.maximum(self.state, 0)] >= 0) | (self.state == DEAD)[..., None]

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
    next_x = jnp.take_along_axis(self.next_ZxV[jnp.maximum(self.state, 0)],
                                 jnp.clip(tokens_x, 0, vocab - 1)[..., None], axis=-1)[..., 0]
    return jnp.where((self.state == DEAD) | (tokens_x >= vocab), DEAD, next_x)

  def along(self, tokens_BxK: jax.Array) -> Constrained:
    """The states [B, K + 1] before each position of the verified block [pending, d_1 .. d_K]: the
    state after pending (this one), then after each draft token in turn. Position i's distribution (of
    d_{i+1}) is masked by state i."""
    states = [self.state]
    for i in range(tokens_BxK.shape[1]):
      states.append(self.replace(state=states[-1]).advance(tokens_BxK[:, i]))
    return self.replace(state=jnp.stack(states, axis=1))

  def after(self, tokens_BxT: jax.Array, counts_B: jax.Array | int) -> Constrained:
    """The state [B] after each row's first `counts_B` tokens of `tokens_BxT` (0: unchanged)."""
    states_BxT1 = self.along(tokens_BxT).state
    return self.replace(state=jnp.take_along_axis(
        states_BxT1, jnp.broadcast_to(jnp.asarray(counts_B, jnp.int32), self.state.shape)[:, None], axis=1)[:, 0])

  def cut(self, proposal: Any) -> Any:
    """A point-mass proposal cut at its first token the constraint does not allow (a lookup's proposal
    is a function of the history, so its length may depend on it). A sampled proposal is left whole:
    cutting it where a draw fails would change the distribution the rule's residual corrects; the target's
    mask rejects such a token instead."""
    if not proposal.point_masses:
      return proposal
    dead_BxK = self.along(proposal.tokens).state[:, 1:] == DEAD
    first_dead_B = jnp.sum(jnp.cumprod(~dead_BxK, axis=1), axis=1).astype(jnp.int32)
    return proposal.replace(lengths=jnp.minimum(proposal.lengths, first_dead_B))

  def check_drafter(self, drafter: Any) -> None:
    """Raises ValueError for a drafter of trees: a tree's states follow each node's ancestors, not done yet."""
    if drafter.tree is not None:
      raise ValueError("constrained decoding drafts chains only: this drafter drafts trees (config.tree)")


def constrained(next_ZxV: Any, start_B: Any) -> Constrained:
  """A constraint on device: a stacked table (`compiler.stack`) and each row's start state."""
  return Constrained(next_ZxV=jnp.asarray(next_ZxV, jnp.int32), state=jnp.asarray(start_B, jnp.int32))
