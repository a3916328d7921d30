"""Drafters: whatever proposes the K tokens that the target verifies in one pass.

Every drafter implements the `Drafter` interface, so a small model, a prompt-lookup n-gram table or
the target's own first layers plug into the same loop:
  init(cache, prompts, lengths) -> state     absorb the prompts into the drafter's preallocated storage
  propose(state, pending, ...)  -> K tokens with the distributions they were drawn from, new state
  commit(state, tokens, num_committed) -> state   keep what the target accepted
A drafter is a pytree whose static configuration lives in non-pytree fields, so it is an ordinary
argument of the jitted loop. A deterministic drafter proposes point masses (one-hot probabilities).

Bookkeeping shared with the loop: the *pending* token is the newest committed token, not yet fed to
any model (the target's cache holds everything before it). A round feeds [pending, d_1 .. d_K] to the
target; if it accepts n draft tokens, the n + 1 tokens [pending, d_1 .. d_n] become history and the
target's next token becomes the new pending one.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Params, forward_hidden, prefill
from specjax.sampling import SamplingParams, probabilities, sample
from specjax.speculative.draft_head import DraftHead, draft_logits


class Drafter(Protocol):
  """The interface the speculative loop drives (all methods are traced inside one `jax.jit`)."""

  @property
  def vocab_size(self) -> int:
    """V: the draft distributions' width; must equal the target's."""

  def calls_per_proposal(self, k: int) -> int:
    """Draft forward passes per proposal of k tokens (static; 0 for a table lookup), for metrics."""

  def init(self, cache: Any, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array) -> Any:
    """The state after the right-padded prompts; `cache` is the drafter's preallocated storage."""

  def propose(self, state: Any, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
              k: int) -> tuple[jax.Array, jax.Array, Any]:
    """K tokens per row following the history and `pending_B`: tokens [B, K] int32, the float32
    distributions [B, K, V] they were drawn from (after `sampling`), and the state. Commits nothing."""

  def commit(self, state: Any, draft_tokens_BxK: jax.Array, num_committed_B: jax.Array) -> Any:
    """Appends the first `num_committed_B[b]` tokens of [pending, d_1 .. d_K] to row b's history
    (0 leaves the row unchanged: done rows stop there)."""


@flax.struct.dataclass
class ModelDraftState:
  cache: KVCache  # [L, B, S, H_kv, D_h] draft cache: the history except `lagging_token` when `behind`
  lagging_token: jax.Array  # [B] int32: the previous round's last draft token d_K
  behind: jax.Array  # [B] bool: the cache lacks `lagging_token` (the previous round accepted all K)


@flax.struct.dataclass
class ModelDrafter:
  """A small language model with its own static KV cache, sampled autoregressively K times.

  Its forward passes feed each draft token d_1 .. d_{K-1} once, so after a round that accepted all K
  tokens the cache lacks d_K (never fed). The next proposal then starts with the two-token chunk
  [d_K, pending] instead of [pending] and reads the logits at the last valid position of each row:
  K forward passes per proposal, never an extra pass just to catch up (and a 1-token first pass when
  no row is behind). Only the position a pass samples from goes through the output head.

  `head` (optional) restricts the output head to a frequent subset of the vocabulary (see
  `draft_head`): cheaper draft steps, same exactness.
  """

  config: ModelConfig = flax.struct.field(pytree_node=False)
  params: Params
  head: DraftHead | None = None

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  def calls_per_proposal(self, k: int) -> int:
    return k

  def init(self, cache: KVCache, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array) -> ModelDraftState:
    batch = prompts_BxP.shape[0]
    cache = cache.replace(lengths=jnp.zeros((batch,), jnp.int32))  # whatever it held before
    _, cache = prefill(self.config, self.params, prompts_BxP, prompt_lengths_B, cache)
    return ModelDraftState(cache=cache, lagging_token=jnp.zeros((batch,), jnp.int32),
                           behind=jnp.zeros((batch,), bool))

  def propose(self, state: ModelDraftState, pending_B: jax.Array, sampling: SamplingParams,
              key: jax.Array, k: int) -> tuple[jax.Array, jax.Array, ModelDraftState]:
    # First pass: [d_K, pending] for rows that are behind, [pending, (unused)] for the others; just
    # [pending] when no row is behind (a 2-token pass costs up to 1.8 single ones on a CPU).
    num_valid_B = 1 + state.behind.astype(jnp.int32)

    def two_tokens(cache):
      chunk_Bx2 = jnp.stack([jnp.where(state.behind, state.lagging_token, pending_B), pending_B], axis=1)
      hidden_Bx2xD, cache = forward_hidden(self.config, self.params, chunk_Bx2, cache)
      return jnp.take_along_axis(hidden_Bx2xD, (num_valid_B - 1)[:, None, None], axis=1)[:, 0], cache

    def one_token(cache):
      hidden_Bx1xD, cache = forward_hidden(self.config, self.params, pending_B[:, None], cache)
      return hidden_Bx1xD[:, 0], cache

    hidden_BxD, cache = jax.lax.cond(jnp.any(state.behind), two_tokens, one_token, state.cache)
    keys_K = jax.random.split(key, k)
    probs_BxV = probabilities(draft_logits(self.config, self.params, self.head, hidden_BxD), sampling)
    token_B = sample(keys_K[0], probs_BxV)

    def step(carry, step_key):
      cache, token_B = carry
      hidden_Bx1xD, cache = forward_hidden(self.config, self.params, token_B[:, None], cache)
      logits_BxV = draft_logits(self.config, self.params, self.head, hidden_Bx1xD[:, 0])
      probs_BxV = probabilities(logits_BxV, sampling)
      next_B = sample(step_key, probs_BxV)
      return (cache.advance(jnp.ones_like(next_B)), next_B), (next_B, probs_BxV)

    # R = K - 1 single-token passes, each feeding the token the previous one drew.
    (cache, _), (rest_RxB, rest_probs_RxBxV) = jax.lax.scan(
        step, (cache.advance(num_valid_B), token_B), keys_K[1:])
    tokens_BxK = jnp.concatenate([token_B[:, None], rest_RxB.T], axis=1)
    probs_BxKxV = jnp.concatenate([probs_BxV[:, None], rest_probs_RxBxV.transpose(1, 0, 2)], axis=1)
    # The cache now holds [d_K?, pending, d_1 .. d_{K-1}] beyond the history, uncommitted.
    return tokens_BxK, probs_BxKxV, state.replace(cache=cache.replace(lengths=state.cache.lengths))

  def commit(self, state: ModelDraftState, draft_tokens_BxK: jax.Array,
             num_committed_B: jax.Array) -> ModelDraftState:
    K = draft_tokens_BxK.shape[1]
    committed_B = num_committed_B > 0
    # Written beyond the history: d_K of last round (if behind), pending, d_1 .. d_{K-1}.
    held_B = jnp.where(committed_B, state.behind + jnp.minimum(num_committed_B, K), 0)
    all_accepted_B = num_committed_B == K + 1
    return ModelDraftState(
        cache=state.cache.advance(held_B),
        lagging_token=jnp.where(all_accepted_B, draft_tokens_BxK[:, -1], state.lagging_token),
        behind=jnp.where(committed_B, all_accepted_B, state.behind))
