"""Autoregressive decoding: the baseline every speedup is measured against.

One `jax.jit` program: a batched, ragged prefill, then a `lax.while_loop` of single-token target
steps. Each row stops on its own (EOS or its budget); no host round trip per token. Static:
the model config, cache size, output width and sampling mode (greedy takes the argmax, sampled draws
from `probabilities`; `SamplingParams`' static flags); runtime: prompts, budgets, the sampling knobs'
values, keys.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import generation, lowering
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Params, forward, prefill
from specjax.sampling import next_tokens


@flax.struct.dataclass
class _LoopState:
  cache: KVCache  # target cache holding every committed token but the last ([L, B, S, G, Dh])
  buffer: generation.OutputBuffer  # generated tokens [B, O], counts [B], done [B]
  last_token: jax.Array  # [B] int32: newest token, not yet fed to the model
  key: jax.Array  # PRNG key, split once per step
  steps: jax.Array  # [] int32: target forward passes after the prefill
  constraint: Any  # the rows' constraint after last_token ([B] DFA states; the null one: nothing)


@flax.struct.dataclass
class AutoregressiveOutput:
  tokens: jax.Array  # [B, out_width] int32, padded with pad_id after each row's count
  counts: jax.Array  # [B] int32: generated tokens per row (EOS included when hit)
  target_calls: jax.Array  # [] int32: forward passes of the target, prefill included
  cache: KVCache  # the final cache (returned so the caller's donated buffer can be reused)


@functools.partial(jax.jit, static_argnames=("config", "out_width", "pad_id"), donate_argnames=("cache",))
def _generate(config: ModelConfig, params: Params, request: generation.Request, cache: KVCache, *, out_width: int,
              pad_id: int) -> AutoregressiveOutput:
  prompts_BxP, sampling = request.prompts_BxP, request.sampling
  budget_B, eos_ids_E = request.max_new_tokens, request.eos_ids
  batch = prompts_BxP.shape[0]
  cache = cache.replace(lengths=jnp.zeros((batch,), jnp.int32))  # whatever it held before
  logits_BxV, cache = prefill(config, params, prompts_BxP, request.prompt_lengths_B, cache)
  key, first_key = jax.random.split(request.key)
  first_B = next_tokens(first_key, logits_BxV, sampling)
  buffer, _ = generation.append(generation.empty_buffer(batch, out_width), first_B[:, None],
                                jnp.ones((batch,), jnp.int32), eos_ids_E, budget_B)

  def cond(state: _LoopState):
    return ~jnp.all(state.buffer.done)

  def body(state: _LoopState):
    logits_Bx1xV, cache = forward(config, params, state.last_token[:, None], state.cache)
    cache = cache.advance(jnp.where(state.buffer.done, 0, 1))
    key, step_key = jax.random.split(state.key)
    next_B = next_tokens(step_key, logits_Bx1xV[:, 0], sampling.replace(constraint=state.constraint))
    buffer, _ = generation.append(state.buffer, next_B[:, None], jnp.ones((batch,), jnp.int32), eos_ids_E, budget_B)
    return _LoopState(cache=cache, buffer=buffer, last_token=next_B, key=key, steps=state.steps + 1,
                      constraint=state.constraint.after(next_B[:, None], 1))

  state = jax.lax.while_loop(
      cond, body,
      _LoopState(cache=cache, buffer=buffer, last_token=first_B, key=key, steps=jnp.int32(0),
                 constraint=sampling.constraint.after(first_B[:, None], 1)))
  return AutoregressiveOutput(tokens=generation.finalize(state.buffer, pad_id)[:, :out_width - 1],
                              counts=state.buffer.counts, target_calls=state.steps + 1, cache=state.cache)


def generate(config: ModelConfig, params: Params, request: generation.Request, cache: KVCache, *,
             out_width: int | None = None, pad_id: int = 0,
             lower: bool | str = False) -> AutoregressiveOutput | jax.stages.Lowered:
  """Generates up to `request.max_new_tokens` (int, or one per row) after each prompt.

  `cache` comes from `init_cache` (any contents; donated: do not reuse the object passed in, pass the
  one returned to the next call). `out_width` (static; defaults to the largest budget) fixes the output shape so that
  calls with smaller budgets reuse the compiled program.
  """
  budget_B, out_width = generation.budgets(request.max_new_tokens, request.prompts_BxP.shape[0], out_width)
  largest = int(jnp.max(budget_B))
  generation.check_fits("autoregressive generate", request.prompt_lengths_B, largest, 0, cache.max_len,
                        config.max_positions)
  return lowering.call_or_lower(_generate, lower, config, params, request.ready(budget_B), cache,
                                out_width=out_width + 1, pad_id=pad_id)  # + 1: room for a done row's ignored write
