"""`HistoryDrafter`: the base of drafters that propose from the committed tokens alone (prompt lookup,
suffix structures, bigram tables, retrieval). A subclass implements one pure JAX method,

  propose_from_history(history_BxS, lengths_B, k) -> (tokens_BxK, num_proposed_B)

traced inside the jitted loop: row b's committed tokens are history_BxS[b, :lengths_B[b]] (the prompt,
then every emitted token, the pending one last; zeros after), and it proposes tokens_BxK[b, :n] with
n = num_proposed_B[b] in [0, K] (0 = nothing; the rest of the row is ignored). The base keeps the history
buffer (a [B, S] int32 array the size of the target's cache, donated to the loop), turns the tokens into
point masses (no [B, K, V] tensor), and verifies with short passes when proposals are short (a round in
which no row proposes anything costs one single-token target step).

Exactness needs nothing from the subclass: a point mass on any token is verified by the acceptance rule
(accept with probability q(d), else draw from q without d), so the output follows the target's
distribution at any temperature and equals its greedy output when greedy, whatever is proposed (ids
outside the target's vocabulary are simply never accepted).

The built drafter gets the target's vocabulary size `vocab_size`; a subclass may add static settings as
`flax.struct.field(pytree_node=False)` fields, read from its config group in `build`.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.sampling import SamplingParams
from specjax.speculative.drafters.base import Drafter, DrafterSettings, short_proposal_widths
from specjax.speculative.plan import RoundPlan
from specjax.speculative.proposal import Proposal


@flax.struct.dataclass
class HistoryState:
  history: jax.Array  # [B, S] int32: committed tokens (prompt, then generated); zeros past `lengths`
  lengths: jax.Array  # [B] int32: committed tokens per row
  pending: jax.Array  # [B] int32: the pending token of the last proposal, the first token commit appends


def spines(tokens_BxRxK: jax.Array, lengths_BxR: jax.Array, vocab_size: int, tree) -> Proposal:
  """The proposal of R chains from the root, the spines tree `tree` = (R, 1, ..., 1) of depth K: branch
  r's first `lengths_BxR[b, r]` tokens, its depth-d node being node (d - 1) R + r + 1. Slots past a
  branch's length hold the id V = `vocab_size`, which no target distribution gives probability (never
  accepted, never equal to an argmax)."""
  batch, branches, k = tokens_BxRxK.shape
  unproposed_BxRxK = jnp.arange(k)[None, None, :] >= lengths_BxR[:, :, None]
  tokens_BxRxK = jnp.where(unproposed_BxRxK, vocab_size, tokens_BxRxK)
  tokens_BxN = jnp.swapaxes(tokens_BxRxK, 1, 2).reshape(batch, k * branches)
  return Proposal(tokens=tokens_BxN, lengths=jnp.max(lengths_BxR, axis=1).astype(jnp.int32), tree=tree)


def appended(rows_BxS: jax.Array, lengths_B: jax.Array, block_BxW: jax.Array, counts_B: jax.Array) -> jax.Array:
  """`rows_BxS` (any trailing dims) with row b's first `counts_B[b]` entries of `block_BxW` written from
  column `lengths_B[b]` on. The other slots go to an out-of-range column and are dropped, as is any write
  past the end (never clamped onto what the row holds)."""
  batch, width = block_BxW.shape[:2]
  slot_1xW = jnp.arange(width)[None, :]
  columns_BxW = jnp.where(slot_1xW < counts_B[:, None], lengths_B[:, None] + slot_1xW, rows_BxS.shape[1])
  rows_BxW = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, width))
  return rows_BxS.at[rows_BxW, columns_BxW].set(block_BxW, mode="drop")


class HistoryDrafter(Drafter):
  """Drafts from the committed token history alone: subclasses implement `propose_from_history`."""

  free_proposal = True  # a lookup: proposed before the K policy chooses, which prices each row's offer
  vocab_size: int = flax.struct.field(pytree_node=False)  # V: the target's vocabulary (proposals are its ids)

  def propose_from_history(self, history_BxS: jax.Array, lengths_B: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(tokens_BxK int, num_proposed_B int in [0, K]) continuing each row's committed tokens
    history_BxS[b, :lengths_B[b]]. Pure JAX with static shapes: it runs inside the jitted loop."""
    raise NotImplementedError(f"{type(self).__name__} must define propose_from_history")

  @classmethod
  def build(cls, settings: DrafterSettings, target, draft, log: Callable[[str], None] = print):
    return cls(vocab_size=target.config.vocab_size, **dict(settings.options)), {}

  def verify_widths(self, k: int) -> tuple[int, ...]:
    return short_proposal_widths(k)  # 1: no live row proposes anything; the pending token runs alone

  def check(self, target_config: ModelConfig) -> None:
    if self.vocab_size != target_config.vocab_size:
      raise ValueError(f"{type(self).__name__} vocabulary ({self.vocab_size}) differs from the target's "
                       f"({target_config.vocab_size}): the proposals must be the target's token ids")

  def storage(self, batch_size: int, max_len: int) -> HistoryState:
    return HistoryState(history=jnp.zeros((batch_size, max_len), jnp.int32), lengths=jnp.zeros(
        (batch_size,), jnp.int32), pending=jnp.zeros((batch_size,), jnp.int32))

  def check_fits(self, storage: HistoryState, prompt_lengths_B: np.ndarray, max_new_tokens: int, k: int) -> None:
    """The history must hold a live row's context: at most prompt + budget - 1 tokens. A live row has
    emitted G <= budget - 1 tokens, so its history holds prompt + G - 1 of them and the pending token
    goes at index prompt + G - 1 <= prompt + budget - 2; a row commits only while it stays live, so
    every committed token lands below that bound too (commit drops any write past the end anyway,
    never clamps it onto the history). Only a finished row may lack room for its pending token, and
    nothing it proposes is emitted or committed. This is K positions less than the target's cache
    needs (prompt + budget + K - 1), so storage of the target cache's size always fits."""
    batch, max_len = storage.history.shape
    if batch != len(prompt_lengths_B):
      raise ValueError(f"history buffer has {batch} rows for {len(prompt_lengths_B)} prompts")
    longest = int(np.max(prompt_lengths_B))
    need = longest + max_new_tokens - 1
    if need > max_len:
      raise ValueError(f"speculative generate (history buffer): longest prompt ({longest} tokens) + "
                       f"max_new_tokens ({max_new_tokens}) - 1 = {need} positions exceed the history size "
                       f"{max_len}; raise its max_len or shorten the prompt/budget")

  def storage_of(self, state: HistoryState) -> HistoryState:
    return state  # `init` overwrites all of it

  def init(self, storage: HistoryState, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
           target_cache: KVCache) -> HistoryState:
    batch, width = prompts_BxP.shape
    columns_BxP = jnp.broadcast_to(jnp.arange(width)[None, :], (batch, width))
    # Padding goes to an out-of-range column and is dropped: the history stays zero past each length.
    columns_BxP = jnp.where(columns_BxP < prompt_lengths_B[:, None], columns_BxP, storage.history.shape[1])
    rows_BxP = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, width))
    history = jnp.zeros_like(storage.history).at[rows_BxP, columns_BxP].set(prompts_BxP.astype(jnp.int32), mode="drop")
    return HistoryState(history=history, lengths=prompt_lengths_B.astype(jnp.int32),
                        pending=jnp.zeros_like(storage.pending))

  def context(self, state: HistoryState, pending_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """([B, S] the history with the pending token written at each row's length, [B] its lengths). A row
    whose history fills all S positions has no room for it; `check_fits` keeps that from happening to a
    live row."""
    position_1xS = jnp.arange(state.history.shape[1])[None, :]
    context_BxS = jnp.where(position_1xS == state.lengths[:, None], pending_B[:, None], state.history)
    return context_BxS, state.lengths + 1

  def propose_from_context(self, context_BxS: jax.Array, context_lengths_B: jax.Array, k: int) -> Proposal:
    """The proposal for the committed tokens: point masses on `propose_from_history`'s tokens (a
    drafter proposing trees of its own overrides this)."""
    tokens_BxK, num_B = self.propose_from_history(context_BxS, context_lengths_B, k)
    if tokens_BxK.shape != (context_BxS.shape[0], k):
      raise ValueError(f"{type(self).__name__}.propose_from_history returned tokens of shape {tokens_BxK.shape}, "
                       f"expected (batch, k) = {(context_BxS.shape[0], k)}")
    return Proposal(tokens=tokens_BxK.astype(jnp.int32), lengths=jnp.clip(num_B, 0, k).astype(jnp.int32))

  def propose(self, state: HistoryState, target_cache: KVCache, pending_B: jax.Array, sampling: SamplingParams,
              key: jax.Array, plan: RoundPlan) -> tuple[Proposal, HistoryState, KVCache]:
    """`key` is unused: the rule is exact for point masses at any temperature; the lookup costs no
    pass, so the plan's cut is left to the loop (which proposes before it plans: `free_proposal`).
    Under a constraint, positions where it allows a single token propose that token
    (`Constrained.force`: jump-forward, free of any lookup)."""
    context_BxS, context_lengths_B = self.context(state, pending_B)
    proposal = sampling.constraint.force(self.propose_from_context(context_BxS, context_lengths_B, plan.k))
    return proposal, state.replace(pending=pending_B.astype(jnp.int32)), target_cache

  def commit(self, state: HistoryState, proposal: Proposal, num_committed_B: jax.Array,
             target_features_BxK1xF: jax.Array) -> HistoryState:
    block_BxK1 = jnp.concatenate([state.pending[:, None], proposal.tokens], axis=1).astype(jnp.int32)
    return state.replace(history=appended(state.history, state.lengths, block_BxK1, num_committed_B),
                         lengths=state.lengths + num_committed_B.astype(jnp.int32))
