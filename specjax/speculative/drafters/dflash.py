"""The DFlash drafter (arXiv 2602.06036): a block head on the target's features fills a whole block of K
draft tokens in one non-causal pass.

The head is an EAGLE head (`eagle_head`: one block reading pairs (fused target feature, token), EAGLE-3's
low/middle/high feature fusion, the target's embedding and output head) with one more parameter, a
learned mask embedding (`eagle_head.MASK_PARAM`). Its history is the EAGLE drafter's: the head's cache
holds the pairs (f_t, x_{t+1}) for t < n - 1, built from the *target's* features (`commit` is EAGLE's),
and `feature` holds f_{n-1}. A round feeds one block of K slots at positions n - 1 .. n + K - 2:

  slot 0: (f_{n-1}, x_n)      slot j >= 1: (f_{n-1}, MASK)

attending to the head's cache and to every slot of the block (bidirectional inside the block: `Block`).
Slot j's output gives q_{j+1}, the head's distribution of x_{n+1+j}; d_{j+1} is drawn from it alone
(position by position under a constraint, `parallel.draw_block`) and q_{j+1} is reported: a distribution
over the next token that ignores d_1 .. d_j is a valid proposal for the chain rule. One pass per round
whatever K (`Proposal.calls` = 1; none in a plain round of the adaptive K policy, whose plan drafts
nothing); the block's cache entries are scratch, rewritten by `commit` from the target's features.
K is the block (the round's proposal bound); the adaptive policy's plan cuts it. Chains only.

Heads are trained by `specjax.distill` (`student.init = "dflash_head"`, `distill.dflash_steps`) and saved
in the EAGLE head layout (`eagle_io`) with `mask/embedding` among the weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import ConfigError
from specjax.sampling import SamplingParams
from specjax.speculative.drafters.base import DrafterSettings
from specjax.speculative.drafters.draft_head import check_vocab_options
from specjax.speculative.drafters.eagle import EagleDrafter, EagleState
from specjax.speculative.drafters.eagle_head import MASK_ID, MASK_PARAM, head_forward, head_logits
from specjax.speculative.drafters.parallel import draw_block
from specjax.speculative.plan import RoundPlan
from specjax.speculative.proposal import Proposal

if TYPE_CHECKING:
  from specjax.models.load import LoadedModel


@dataclasses.dataclass(frozen=True)
class Block:
  """`size` slots written after the committed cache, each seeing the committed cache and every slot of
  the block (itself included): a non-causal chunk for the model's tree attention (`attention_mask`),
  slot t at position `length + t`."""

  size: int
  first: int = 0  # the chunk's first slot (`attention_mask`): the block is one chunk

  @property
  def depth(self) -> tuple[int, ...]:
    return tuple(range(self.size))

  @property
  def key_depth(self) -> tuple[int, ...]:
    return self.depth

  @functools.cache
  def ancestor_mask(self) -> np.ndarray:
    """[size, size] bool: all True (bidirectional)."""
    return np.ones((self.size, self.size), bool)


def block_inputs(pending_B: jax.Array, k: int) -> jax.Array:
  """The block's tokens [B, K]: pending, then MASK_ID (the head's learned mask) in the K - 1 slots."""
  return jnp.concatenate([pending_B[:, None], jnp.full((pending_B.shape[0], k - 1), MASK_ID, pending_B.dtype)], axis=1)


class DFlashDrafter(EagleDrafter):
  """A DFlash block head drafting K tokens per round in one pass (see the module docstring)."""

  name: ClassVar[str] = "dflash"
  cache_name: ClassVar[str] = "DFlash head"

  def passes(self, length: int) -> int:
    """One head pass proposes the whole block (none in a plain round)."""
    return int(length > 0)

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    if not settings.draft:
      raise ConfigError("config.draft is empty but config.drafter is 'dflash': give the head's directory "
                        "(specjax.distill, student.init = 'dflash_head')")
    if settings.tree is not None:
      raise ConfigError("config.tree is set but config.drafter 'dflash' drafts a block (a chain), no trees")
    check_vocab_options(settings.options, settings.group)

  @classmethod
  def build(cls, settings: DrafterSettings, target: LoadedModel, draft: LoadedModel | None,
            log: Callable[[str], None] = print) -> tuple[DFlashDrafter, dict]:
    drafter, facts = super().build(settings, target, draft, log)
    if MASK_PARAM not in drafter.params:
      raise ConfigError(f"config.draft {settings.draft} is an EAGLE head without a mask embedding, not a DFlash "
                        "head: train one with student.init = 'dflash_head'")
    return drafter, facts

  def check(self, target_config) -> None:
    super().check(target_config)
    shape = self.params[MASK_PARAM]["embedding"].shape if MASK_PARAM in self.params else None
    if shape != (self.config.block.d_model,):
      raise ValueError(f"a DFlash head needs {MASK_PARAM}/embedding of shape ({self.config.block.d_model},), "
                       f"got {shape}")

  def draft_block(self, state: EagleState, pending_B: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Float32 logits [B, K, V] of the block [pending, MASK x (K - 1)] from one head pass, and the head's
    cache with the block written beyond its length (scratch)."""
    tokens_BxK = block_inputs(pending_B, k)
    fused_BxKxD = jnp.broadcast_to(state.feature[:, None], (pending_B.shape[0], k, state.feature.shape[-1]))
    out_BxKxD, cache = head_forward(self.config, self.params, self._embedding(), tokens_BxK, fused_BxKxD, state.cache,
                                    tree=Block(k))
    return head_logits(self.config, self.params, self.target_config, self.target_params, self.vocab, out_BxKxD), cache

  def propose_chain(self, state: EagleState, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
                    plan: RoundPlan) -> tuple[Proposal, EagleState]:
    """K tokens per row, d_i drawn from q_i alone, from one pass (none when the plan drafts nothing)."""
    k, batch = plan.k, pending_B.shape[0]

    def draw(cache):
      logits_BxKxV, cache = self.draft_block(state.replace(cache=cache), pending_B, k)
      tokens_BxK, probs_BxKxV = draw_block(key, logits_BxKxV, sampling)
      return tokens_BxK, probs_BxKxV, cache, jnp.int32(1)

    def plain(cache):
      shapes = jax.eval_shape(draw, cache)
      return (*(None if s is None else jnp.zeros(s.shape, s.dtype) for s in shapes[:2]), cache, jnp.int32(0))

    tokens_BxK, probs_BxKxV, cache, calls = plan.unless_plain(draw, plain, state.cache)
    proposal = Proposal(tokens=tokens_BxK, lengths=plan.clip(jnp.full((batch,), k, jnp.int32)), probs=probs_BxKxV,
                        calls=calls)
    # As EAGLE's chain: the written cache is kept at its old length (`commit` rewrites the block's slots).
    return proposal, state.replace(cache=cache.replace(lengths=state.cache.lengths), pending=pending_B)
