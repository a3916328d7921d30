"""Speculative decoding: one `jax.jit` program, a ragged prefill of both models, then a
`lax.while_loop` of rounds. Each round the drafter proposes K tokens per row, the target scores
[pending, d_1 .. d_K] in one pass, the acceptance rule keeps a prefix and draws the next token, and
each row advances by its own n + 1 tokens. Rows stop on their own (EOS or budget) and then stop
changing; no host round trip per round.

Static (changing them recompiles): the model configs, K, the output width, the cache sizes (array
shapes) and the acceptance rule. Runtime: prompts, budgets, EOS ids, sampling knobs, keys.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from specjax import generation, metrics
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Params, forward, prefill
from specjax.sampling import SamplingParams, probabilities, sample
from specjax.speculative import acceptance
from specjax.speculative.draft_head import DraftHead
from specjax.speculative.drafters import Drafter, ModelDrafter

AcceptanceRule = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


@flax.struct.dataclass
class _LoopState:
  target_cache: KVCache  # [L, B, S, H_kv, D_h] target cache: every committed token but the pending one
  draft_state: Any  # the drafter's (ModelDraftState: draft cache [L', B, S', H_kv', D_h'], [B] flags)
  buffer: generation.OutputBuffer  # generated tokens [B, N], counts [B], done [B]
  pending: jax.Array  # [B] int32: newest committed token, not yet fed to either model
  key: jax.Array  # PRNG key, split once per round
  counts: metrics.AcceptanceCounts  # per-row acceptance counters: [B], [B], [B, K]


@flax.struct.dataclass
class SpeculativeOutput:
  tokens: jax.Array  # [B, out_width] int32, padded with pad_id after each row's count
  counts: jax.Array  # [B] int32: generated tokens per row (EOS included when hit)
  target_calls: jax.Array  # [] int32: target forward passes, prefill included (rounds + 1)
  draft_calls: jax.Array  # [] int32: draft forward passes proposing tokens (prompt prefill excluded)
  acceptance: metrics.AcceptanceCounts  # per-row rounds [B], accepted [B], accepted per position [B, K]
  target_cache: KVCache  # final caches, returned so the donated buffers can be reused
  draft_state: Any  # the drafter's final state (ModelDraftState.cache is the draft cache)


@functools.partial(jax.jit, static_argnames=("target_config", "k", "out_width", "pad_id", "rule"),
                   donate_argnames=("target_cache", "draft_cache"))
def _generate(target_config: ModelConfig, target_params: Params, drafter: Drafter, prompts_BxP: jax.Array,
              prompt_lengths_B: jax.Array, target_cache: KVCache, draft_cache: Any, budget_B: jax.Array,
              eos_ids_E: jax.Array, sampling: SamplingParams, key: jax.Array, *, k: int, out_width: int,
              pad_id: int, rule: AcceptanceRule) -> SpeculativeOutput:
  batch = prompts_BxP.shape[0]
  target_cache = target_cache.replace(lengths=jnp.zeros((batch,), jnp.int32))  # whatever it held before
  logits_BxV, target_cache = prefill(target_config, target_params, prompts_BxP, prompt_lengths_B,
                                     target_cache)
  draft_state = drafter.init(draft_cache, prompts_BxP, prompt_lengths_B)
  key, first_key = jax.random.split(key)
  first_B = sample(first_key, probabilities(logits_BxV, sampling))
  # Room for a whole block of K + 1 tokens appended at a count of up to out_width - 1.
  buffer, _ = generation.append(generation.empty_buffer(batch, out_width + k + 1), first_B[:, None],
                                jnp.ones((batch,), jnp.int32), eos_ids_E, budget_B)

  def cond(state: _LoopState):
    return ~jnp.all(state.buffer.done)

  def body(state: _LoopState):
    key, draft_key, accept_key = jax.random.split(state.key, 3)
    draft_BxK, draft_probs_BxKxV, draft_state = drafter.propose(state.draft_state, state.pending,
                                                                sampling, draft_key, k)
    block_BxK1 = jnp.concatenate([state.pending[:, None], draft_BxK], axis=1)
    logits_BxK1xV, target_cache = forward(target_config, target_params, block_BxK1, state.target_cache)
    num_accepted_B, next_B = rule(accept_key, draft_BxK, draft_probs_BxKxV,
                                  probabilities(logits_BxK1xV, sampling))
    # Emitted this round: d_1 .. d_n, then the drawn token at index n.
    emitted_BxK1 = jnp.where(jnp.arange(k + 1)[None, :] < num_accepted_B[:, None],
                             jnp.pad(draft_BxK, ((0, 0), (0, 1))), next_B[:, None])
    buffer, _ = generation.append(state.buffer, emitted_BxK1, num_accepted_B + 1, eos_ids_E, budget_B)
    live_B = ~state.buffer.done
    # Rows that just finished commit nothing either: their caches stay where the capacity check counts.
    num_committed_B = jnp.where(buffer.done, 0, num_accepted_B + 1)
    return _LoopState(target_cache=target_cache.advance(num_committed_B),
                      draft_state=drafter.commit(draft_state, draft_BxK, num_committed_B),
                      buffer=buffer, pending=jnp.where(buffer.done, state.pending, next_B), key=key,
                      counts=metrics.record(state.counts, num_accepted_B, live_B))

  state = jax.lax.while_loop(cond, body, _LoopState(
      target_cache=target_cache, draft_state=draft_state, buffer=buffer, pending=first_B, key=key,
      counts=metrics.zero_counts(batch, k)))
  rounds = jnp.max(state.counts.rounds)  # a row is live in a prefix of the rounds; some row in each
  return SpeculativeOutput(
      tokens=generation.finalize(state.buffer, pad_id)[:, :out_width], counts=state.buffer.counts,
      target_calls=rounds + 1, draft_calls=rounds * drafter.calls_per_proposal(k),
      acceptance=state.counts, target_cache=state.target_cache, draft_state=state.draft_state)


def speculative_generate(target_config: ModelConfig, target_params: Params, draft_config: ModelConfig,
                         draft_params: Params, prompts_BxP, prompt_lengths_B, target_cache: KVCache,
                         draft_cache: KVCache, max_new_tokens, eos_ids, sampling: SamplingParams,
                         key: jax.Array, *, k: int, out_width: int | None = None, pad_id: int = 0,
                         rule: AcceptanceRule = acceptance.verify,
                         draft_head: DraftHead | None = None) -> SpeculativeOutput:
  """Generates up to `max_new_tokens` (int, or one per row) after each prompt, drafting K tokens per
  round with the draft model; the output is distributed exactly as the target's own sampling (equal
  to it token for token when greedy).

  The caches come from `init_cache` (any contents; both are donated: use the ones returned) and must
  hold the longest prompt + budget + K - 1 positions: a live row has emitted G <= budget - 1 tokens,
  so its caches hold at most prompt + G - 1 of them and its round writes the K + 1 block [pending,
  d_1 .. d_K] (the draft at most K tokens past the same point) before the end; a finished row commits
  nothing in its last round and keeps rewriting the same uncommitted positions while others run.
  `out_width` (static; defaults to the largest budget) fixes the output shape so that calls with
  smaller budgets reuse the compiled program. `rule` (static) is the acceptance rule, replaceable for
  experiments (the tests inject broken ones to show the exactness tests can fail). `draft_head`
  restricts the draft's output head to a frequent subset of the vocabulary (`draft_head.restrict_head`).
  """
  if int(k) != k or k < 1:
    raise ValueError(f"k (draft tokens per round) must be an integer >= 1, got {k}")
  if draft_config.vocab_size != target_config.vocab_size:
    raise ValueError(f"draft vocabulary ({draft_config.vocab_size}) differs from the target's "
                     f"({target_config.vocab_size}): the acceptance ratio needs one token space")
  if draft_head is not None and draft_head.weight_NxD.shape[1] != draft_config.d_model:
    raise ValueError(f"draft_head rows have width {draft_head.weight_NxD.shape[1]}, the draft's "
                     f"d_model is {draft_config.d_model}: restrict the draft's own head")
  batch = prompts_BxP.shape[0]
  for name, cache in (("target", target_cache), ("draft", draft_cache)):
    if cache.batch_size != batch:
      raise ValueError(f"{name} cache has {cache.batch_size} rows for {batch} prompts")
  budget_B, out_width = generation.budgets(max_new_tokens, batch, out_width)
  largest = int(jnp.max(budget_B))
  generation.check_fits("speculative generate (target)", prompt_lengths_B, largest, k - 1,
                        target_cache.max_len, target_config.max_positions)
  generation.check_fits("speculative generate (draft)", prompt_lengths_B, largest, k - 1,
                        draft_cache.max_len, draft_config.max_positions)
  return _generate(target_config, target_params, ModelDrafter(draft_config, draft_params, draft_head),
                   jnp.asarray(prompts_BxP, jnp.int32), jnp.asarray(prompt_lengths_B, jnp.int32),
                   target_cache, draft_cache, budget_B, jnp.asarray(eos_ids, jnp.int32).reshape(-1),
                   sampling, key, k=k, out_width=out_width, pad_id=pad_id, rule=rule)
