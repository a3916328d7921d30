"""Branching that keeps a large operand (a KV cache) in place.

XLA copies the operand of a `lax.cond`/`lax.switch` whose branches update it: JAX lowers the branches
with implicit captures, the conversion to HLO hands each branch its own tuple of them, and copy
insertion then cannot prove the in-place update safe, so it copies the whole operand on entry or exit
of the branch (every layer's keys and values, every round). A `while_loop` carrying the operand updates
it in place. `switch` therefore runs each branch inside its own loop of zero or one trip: the same
work, one predicate check per branch, no copy (`tests/test_cache_inplace.py` reads the programs).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


def _zero_extras(branch: Callable[[Any], tuple[Any, Any]], operand: Any) -> Any:
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(branch, operand)[1])


def _trip(predicate: jax.Array, branch: Callable[[Any], tuple[Any, Any]], operand: Any, extras: Any) -> tuple[Any, Any]:
  """`branch(operand)` when `predicate` holds, else (`operand`, `extras`): a loop of zero or one trip."""
  _, operand, extras = jax.lax.while_loop(lambda carry: carry[0], lambda carry: (jnp.bool_(False), *branch(carry[1])),
                                          (jnp.asarray(predicate), operand, extras))
  return operand, extras


def switch(index: jax.Array, branches: Sequence[Callable[[Any], tuple[Any, Any]]], operand: Any) -> tuple[Any, Any]:
  """`lax.switch(index, branches, operand)` for branches `operand -> (operand', extras)` that update
  `operand` (any pytree) in place; `extras` must have one structure and shape across branches. An
  index outside [0, len(branches)) runs the last branch, as `lax.switch` clamps it."""
  if len(branches) == 1:
    return branches[0](operand)
  index = jnp.clip(index, 0, len(branches) - 1)
  extras = _zero_extras(branches[0], operand)
  for n, branch in enumerate(branches):
    operand, extras = _trip(index == n, branch, operand, extras)
  return operand, extras


def cond(predicate: jax.Array, true_branch: Callable[[Any], tuple[Any, Any]],
         false_branch: Callable[[Any], tuple[Any, Any]], operand: Any) -> tuple[Any, Any]:
  """`switch` with two branches, `true_branch` when `predicate` holds."""
  return switch(predicate.astype(jnp.int32), (false_branch, true_branch), operand)


def when(predicate: jax.Array, branch: Callable[[Any], tuple[Any, Any]], operand: Any) -> tuple[Any, Any]:
  """`branch(operand)` when `predicate` holds, else `operand` unchanged and zeros for `extras`: a
  one-branch `cond` (one predicate check; no second branch to trace or compile)."""
  return _trip(predicate, branch, operand, _zero_extras(branch, operand))
