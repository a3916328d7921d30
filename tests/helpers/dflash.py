"""The DFlash drafter's test kit: random and briefly trained block heads on the tiny targets, and its mutant.

Mutant (a subclass of `DFlashDrafter`, a plausible bug the tests must reject):
- `FirstDistributionReported`: every block position reports q_1 (slot 0's distribution) while d_i is
  still drawn from q_i: the rule is handed a distribution the token was not drawn from.
"""

import jax
import jax.numpy as jnp
import optax

from specjax.distill import dflash_steps
from specjax.speculative.drafters.dflash import DFlashDrafter
from tests.helpers.eagle import eagle_head


class FirstDistributionReported(DFlashDrafter):
  def propose_chain(self, state, pending_B, sampling, key, plan):
    proposal, state = super().propose_chain(state, pending_B, sampling, key, plan)
    probs_BxKxV = None if proposal.probs is None else jnp.broadcast_to(proposal.probs[:, :1], proposal.probs.shape)
    return proposal.replace(probs=probs_BxKxV), state


def dflash_drafter(target, feature_layers=(0, 1, 2), seed=3, final_scale=1.0, cls=DFlashDrafter):
  """A random DFlash head for `target` (config, params) as the drafter `cls`."""
  config, params = eagle_head(target[0], feature_layers, seed, final_scale, mask=True)
  return cls(config, params, target[0], target[1])


def trained_dflash_drafter(target, steps=100, seed=0, rows=16, seq_len=12, block=2, cls=DFlashDrafter):
  """A DFlash head for `target` trained by `dflash_steps.block_loss` (Adam, `steps` steps on rows of
  uniform random tokens, all anchors' blocks): slot 0 learns the target's next-token distribution, later
  slots an average over the tokens between, so q_1 and q_2 differ and d_1 is accepted often."""
  config, params = eagle_head(target[0], (0, 1, 2), seed, final_scale=1.0, mask=True)
  objective = dflash_steps.BlockObjective(block, seq_len - 1, 4.0)
  optimizer = optax.adam(3e-2)

  @jax.jit
  def step(params, opt_state, key):
    tokens_key, anchor_key = jax.random.split(key)
    tokens_BxT = jax.random.randint(tokens_key, (rows, seq_len), 0, target[0].vocab_size, jnp.int32)
    loss = lambda p: dflash_steps.block_loss(config, p, target[0], target[1], tokens_BxT, jnp.ones(
        (rows, seq_len), bool), objective, anchor_key)[0]
    grads = jax.grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state

  opt_state = optimizer.init(params)
  for i in range(steps):
    params, opt_state = step(params, opt_state, jax.random.key(seed * 1_000_003 + i))
  return cls(config, params, target[0], target[1])
