"""`specjax.inplace.switch`/`cond` compute what `lax.switch`/`lax.cond` compute (each branch index, an index
out of range clamped as `lax.switch` clamps it, extras of any pytree), and update the operand in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import inplace
from tests.helpers.hlo import whole_cache_moves

SHAPE = (2, 3, 40, 2, 8)  # a cache-like operand: [L, B, S, G, Dh]


def _branches():
  """Three branches that write different rows of the operand and return different extras."""
  return [
      lambda x, n=n: (x.at[:, :, n].set(float(n + 1)), {"n": jnp.int32(n), "row": x[0, 0, n + 1]}) for n in range(3)
  ]


@pytest.mark.parametrize("index", [-1, 0, 1, 2, 5])
def test_switch_equals_lax_switch(index):
  operand = jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE)
  ours = jax.jit(lambda i, x: inplace.switch(i, _branches(), x))(jnp.int32(index), operand)
  reference = jax.jit(lambda i, x: jax.lax.switch(i, _branches(), x))(jnp.int32(index), operand)
  jax.tree.map(np.testing.assert_array_equal, ours, reference)


@pytest.mark.parametrize("predicate", [False, True])
def test_cond_runs_the_true_branch_when_the_predicate_holds(predicate):
  false_branch, true_branch = _branches()[:2]
  operand = jnp.zeros(SHAPE)
  _, extras = jax.jit(lambda p, x: inplace.cond(p, true_branch, false_branch, x))(jnp.bool_(predicate), operand)
  assert int(extras["n"]) == int(predicate)


@pytest.mark.parametrize("predicate", [False, True])
def test_when_runs_its_branch_only_when_the_predicate_holds(predicate):
  branch = _branches()[2]
  operand = jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE)
  got, extras = jax.jit(lambda p, x: inplace.when(p, branch, x))(jnp.bool_(predicate), operand)
  want = branch(operand) if predicate else jax.tree.map(jnp.zeros_like, branch(operand))
  np.testing.assert_array_equal(got, want[0] if predicate else operand)
  jax.tree.map(np.testing.assert_array_equal, extras, want[1])


def test_switch_in_a_loop_copies_no_operand_and_lax_switch_does():
  def program(switch):
    return jax.jit(lambda x, steps: jax.lax.fori_loop(
        0, steps, lambda i, x: switch(i % 3, [lambda x, b=b: b(x)[0] for b in _branches()], x), x))

  ours = lambda i, branches, x: inplace.switch(i, [lambda x, b=b: (b(x), ()) for b in branches], x)[0]
  args = (jnp.zeros(SHAPE), jnp.int32(4))
  compiled = lambda switch: program(switch).lower(*args).compile().as_text()
  # One copy of the (not donated) input before the loop is allowed; lax.switch adds one per branch.
  assert len(whole_cache_moves(compiled(ours), SHAPE)) <= 1
  assert len(whole_cache_moves(compiled(jax.lax.switch), SHAPE)) > 1
