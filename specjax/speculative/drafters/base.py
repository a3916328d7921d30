"""The Drafter interface: whatever proposes the tokens that the target verifies in one pass.

A small model (`ModelDrafter`), a prompt-lookup n-gram table (`NgramDrafter`), the target's own first
layers (`LayerSkipDrafter`) and trained heads that read the target's hidden states (`EagleDrafter`) plug
into the same loop (`speculative_generate`). A drafter is a pytree: arrays (weights) are pytree fields,
its static configuration lives in non-pytree fields, so it is an ordinary argument of the jitted loop.
Host side, before anything compiles:
  check(target_config)                  the drafter fits this target (vocabulary, layers, ...)
  storage(batch, max_len)               its preallocated, donated storage (a KV cache, a token buffer)
  check_fits(storage, lengths, budget, k)   the storage holds the longest prompt + budget + look-ahead
  storage_of(state)                     the storage inside a returned final state, for the next call
Inside the jitted loop:
  init(storage, prompts, lengths, target_cache) -> state
  propose(state, target_cache, pending, sampling, key, k) -> (Proposal, state, target_cache)
  commit(state, proposal, num_committed, target_hidden) -> state
A proposal counts the draft forward passes it cost (`Proposal.calls`, 0 for a lookup) for the metrics.
Optional static field `feature_layers` (`feature_layers(drafter)`, default ()): the target blocks whose
residual streams `commit` receives instead of the final-norm hidden states (EAGLE-3 heads).
Static: `verify_widths(k)` (the verify-pass widths the loop chooses among: a round whose longest live proposal
holds n tokens runs the narrowest width >= n + 1; a drafter that always proposes K tokens needs only K + 1).

Bookkeeping shared with the loop: the *pending* token is the newest committed token, not yet fed to the
target (its cache holds everything before it). A round feeds [pending, d_1 .. d_W-1] to the target; if
row b accepts n draft tokens, the n + 1 tokens [pending, d_1 .. d_n] become history (`commit` receives
num_committed = n + 1; 0 for a row that is done) and the target's next token becomes the new pending one.
A proposal may be a static tree (`Proposal.tree`, e.g. `ModelDrafter(tree=...)`): the loop verifies its
nodes in one pass and hands `commit` the accepted path as a chain (`Proposal.along`, with `path` set).
`propose` may read and write the target's cache beyond each row's length (self-speculation shares it):
whatever it writes there is overwritten by the verify pass before any of it is committed.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.sampling import SamplingParams
from specjax.speculative.proposal import Proposal


class DraftPass(NamedTuple):
  """One draft forward pass: a model, optionally through a restricted head or a subset of its layers."""

  config: ModelConfig
  params: Any
  head: Any = None  # a `draft_head.DraftHead`, or None for the full output head
  layers: tuple[int, ...] | None = None  # the blocks run, None for all


class Drafter(Protocol):
  """The interface the speculative loop drives (`init`, `propose`, `commit` are traced inside one
  `jax.jit`; the rest runs on the host)."""

  @property
  def vocab_size(self) -> int:
    """W: the ids the proposals' distributions span. A model drafter may differ from the target's V
    (padding rows; the acceptance rule extends the smaller distribution with zeros); drafters that
    propose the target's own ids (n-gram lookup, layer skip) have the target's V."""

  def verify_widths(self, k: int) -> tuple[int, ...]:
    """The verify-pass widths (static, ascending, the last one K + 1) the loop may run."""

  def check(self, target_config: ModelConfig) -> None:
    """Raises ValueError unless the drafter can draft for this target."""

  def draft_pass(self) -> DraftPass | None:
    """What one draft forward pass runs, for its cost model (`specjax.costs`); None for a lookup."""

  def storage(self, batch_size: int, max_len: int) -> Any:
    """Preallocated storage for `batch_size` rows of up to `max_len` positions (donated to the loop)."""

  def check_fits(self, storage: Any, prompt_lengths_B: np.ndarray, max_new_tokens: int, k: int) -> None:
    """Raises ValueError unless `storage` holds the longest prompt, the budget and the look-ahead."""

  def storage_of(self, state: Any) -> Any:
    """The storage held by a state the loop returned (`SpeculativeOutput.draft_state`): passed to the
    next call of the same shapes instead of allocating new storage (it is donated again)."""

  def init(self, storage: Any, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
           target_cache: KVCache) -> Any:
    """The state after the right-padded prompts (the target's cache already holds them). A drafter that
    reads the target's features may define `init_from_features(storage, prompts_BxP, prompt_lengths_B,
    features_BxPxF)` instead: the loop then prefills the target with `prefill_features` (its
    `feature_layers`) and hands it the prompts' features, so no second target prefill runs."""

  def propose(self, state: Any, target_cache: KVCache, pending_B: jax.Array, sampling: SamplingParams,
              key: jax.Array, k: int) -> tuple[Proposal, Any, KVCache]:
    """Up to K tokens per row following the history and `pending_B` (their distributions after
    `sampling`, or point masses), the state, and the target's cache (changed only beyond each row's
    length). Commits nothing."""

  def commit(self, state: Any, proposal: Proposal, num_committed_B: jax.Array,
             target_hidden_BxK1xD: jax.Array) -> Any:
    """Appends the first `num_committed_B[b]` tokens of [pending, d_1 .. d_K] to row b's history (0
    leaves the row unchanged: done rows stop there). `target_hidden_BxK1xD` holds the target's
    features of the verified block (positions past the pass's width are zeros): its final-norm hidden
    states, or the residual streams after the blocks the drafter names in `feature_layers`."""


def feature_layers(drafter: Drafter) -> tuple[int, ...]:
  """The target blocks whose residual streams (concatenated) `commit` receives, from the drafter's
  optional static `feature_layers` field; () (the default) = the target's final-norm hidden states."""
  return getattr(drafter, "feature_layers", ())


def short_proposal_widths(k: int) -> tuple[int, ...]:
  """Verify widths for drafters whose proposals are often short (n-gram lookups, early-stopped drafts):
  1 (no proposal), 2, 3 and 4 (one to three tokens), then the full K + 1. Each width is one more
  compiled target pass; on a CPU a 4-token pass costs about 2 single steps where a 9-token one costs
  about 2.7, so short proposals should not pay for the full block."""
  return tuple(sorted(set(range(1, min(k + 1, 5))) | {k + 1}))
