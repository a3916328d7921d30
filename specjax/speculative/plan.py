"""The round plan: what the K policy lets a round propose, decided before the round's draft from earlier
rounds only (`k_policy`), and the one thing a drafter learns of the policy (`Drafter.propose`).

Two plans answer the same questions. `RoundPlan` is the null plan of the fixed policy: every round may
propose all K tokens (a static tree: all of it), and every answer is a Python constant, so a drafter
given it compiles to the classic fixed program. `ChosenPlan` carries the adaptive policy's choice as
arrays: the depth each row may propose (0 = a plain target step) and, for a branching static tree,
whether the round verifies only the cut's spine (`Tree.spine`). A drafter may ignore either, at the
price of draft passes nobody reads: the loop never verifies more than the plan allows.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from specjax import inplace


@flax.struct.dataclass
class RoundPlan:
  """A round's plan, and the null one of the fixed policy: every row may propose all K tokens (static
  answers). `ChosenPlan` answers the same questions with the adaptive policy's arrays."""

  k: int = flax.struct.field(pytree_node=False)  # the most draft tokens a round proposes (a static tree's depth)

  @property
  def depth(self) -> int | jax.Array:
    """The most tokens (a static tree: the depth of its cut) any row may propose: K, static here."""
    return self.k

  @property
  def drafts(self) -> bool | jax.Array:
    """Whether some row may propose a token (False: a plain round, whose draft may be skipped)."""
    return True

  @property
  def spine(self) -> jax.Array | None:
    """[] bool where the round verifies only the tree cut's spine; None = never (static)."""
    return None

  def clip(self, lengths_B: jax.Array) -> jax.Array:
    """Proposal lengths [B] cut to what each row may propose (the loop verifies no more)."""
    return lengths_B

  def extend(self, lengths_B: jax.Array) -> jax.Array:
    """Point-mass proposal lengths [B] as verified: what each row may propose where the plan is `full`
    (calibration times the pass of the chosen length, whatever a lookup found), else unchanged."""
    return lengths_B

  def unless_plain(self, draw: Callable, plain: Callable, *operands: Any) -> Any:
    """`draw(*operands)`, or `plain(*operands)` in a round that drafts nothing (one branch: `lax.cond`)."""
    return draw(*operands)

  def beyond(self, depth: int, run: Callable[[Any], tuple[Any, Any]], operand: Any) -> tuple[Any, Any]:
    """`run(operand)` -> (operand, extras) where the round reaches past `depth` (static), else the
    operand unchanged and zero extras (`inplace.when`)."""
    return run(operand)


@flax.struct.dataclass
class ChosenPlan(RoundPlan):
  """The adaptive policy's choice: row b may propose `wanted_B[b]` tokens (a static tree: its cut at
  that depth), only the cut's spine where `spine_flag` holds."""

  wanted_B: jax.Array  # [B] int32 in [0, K]
  spine_flag: jax.Array | None = None  # [] bool; None when no candidate verifies a spine (static)
  full: jax.Array | bool = False  # [] bool: point-mass proposals are verified at wanted_B whole (`extend`)

  @property
  def depth(self) -> jax.Array:
    return jnp.minimum(jnp.max(self.wanted_B), self.k)

  @property
  def drafts(self) -> jax.Array:
    return jnp.max(self.wanted_B) > 0

  @property
  def spine(self) -> jax.Array | None:
    return self.spine_flag

  def clip(self, lengths_B: jax.Array) -> jax.Array:
    return jnp.minimum(lengths_B, self.wanted_B)

  def extend(self, lengths_B: jax.Array) -> jax.Array:
    return jnp.where(self.full, self.wanted_B, lengths_B)

  def unless_plain(self, draw: Callable, plain: Callable, *operands: Any) -> Any:
    return jax.lax.cond(self.drafts, draw, plain, *operands)

  def beyond(self, depth: int, run: Callable[[Any], tuple[Any, Any]], operand: Any) -> tuple[Any, Any]:
    return inplace.when(depth < self.depth, run, operand)
