"""Wall-clock cost of forward passes: the draft/target cost ratio c of the theory, and T-token costs.

`metrics.theoretical_speedup(alpha, K, c)` needs c, the time of one draft pass relative to one target
pass. It is measured, not derived from parameter counts, by timing jitted single-step forwards of the
two models, alternating, at a fixed cache offset (compilation excluded: the first call of each shape is
a warm-up). The benchmarks and sweeps in `experiments/` share these helpers so that every c is
measured the same way.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import forward_hidden
from specjax.speculative import k_policy
from specjax.speculative.drafters.base import DraftPass
from specjax.speculative.drafters.draft_head import DraftHead, draft_logits
from specjax.speculative.k_policy import KPolicy


@functools.partial(jax.jit, static_argnames=("config", "layers"), donate_argnames=("cache",))
def _step(config: ModelConfig, layers: tuple[int, ...] | None, params, head, tokens_BxT, cache):
  """One timed forward (module level: timers of the same model and shapes share its compiled program)."""
  hidden_BxTxD, cache = forward_hidden(config, params, tokens_BxT, cache, layers)
  return draft_logits(config, params, head, hidden_BxTxD).argmax(-1), cache


def forward_timer(config: ModelConfig, params, T: int, batch_size: int, cache_len: int, offset: int,
                  head: DraftHead | None, layers: tuple[int, ...] | None = None) -> Callable[[], float]:
  """Compiles (once per model and shape) and runs once a jitted forward of [batch_size, T] tokens with
  `offset` positions cached, through the restricted output `head` when one is given and the blocks
  `layers` only when given; each call of the result times one more."""
  step = functools.partial(_step, config, layers)
  tokens_BxT = jnp.ones((batch_size, T), jnp.int32)
  out_BxT, cache = step(params, head, tokens_BxT,
                        init_cache(config, batch_size, cache_len).advance(jnp.full((batch_size,), offset)))
  out_BxT.block_until_ready()  # compiled; the cache is written, not advanced: every call sees `offset`
  state = {"cache": cache}

  def timed() -> float:
    start = time.perf_counter()
    out_BxT, state["cache"] = step(params, head, tokens_BxT, state["cache"])
    out_BxT.block_until_ready()
    return time.perf_counter() - start

  return timed


def forward_seconds(config: ModelConfig, params, tokens: Iterable[int], repeats: int, batch_size: int = 1,
                    cache_len: int = 256, offset: int = 100, head: DraftHead | None = None) -> dict[int, float]:
  """Median seconds of one jitted forward of [batch_size, T] tokens, for each T in `tokens`, with
  `offset` positions already cached (each T and batch size compiles once, before the timed calls);
  through the restricted output `head` when one is given (a `draft_vocab` draft)."""
  seconds = {}
  for T in tokens:
    timed = forward_timer(config, params, T, batch_size, cache_len, offset, head)
    seconds[T] = float(np.median([timed() for _ in range(repeats)]))
  return seconds


def interleaved_medians(timers: dict[Any, Callable[[], float]], repeats: int) -> dict[Any, float]:
  """Median seconds of each timer over `repeats` rounds in which every timer runs once, in turn: drift
  of a shared machine moves them all alike instead of biasing whichever ran during it."""
  samples = {name: [] for name in timers}
  for _ in range(repeats):
    for name, timed in timers.items():
      samples[name].append(timed())
  return {name: float(np.median(seconds)) for name, seconds in samples.items()}


def pass_timers(target_config: ModelConfig, target_params, drafter, widths: Iterable[int], batch_size: int,
                cache_len: int, offset: int) -> dict[Any, Callable[[], float]]:
  """Timers (`forward_timer`, at `offset` cached positions) of the target's pass over each width T of
  `widths` and, under "draft", of one 1-token pass of what `drafter` drafts with (`Drafter.draft_pass`;
  none for a lookup, or without a drafter)."""
  timers = {T: forward_timer(target_config, target_params, T, batch_size, cache_len, offset, None) for T in widths}
  draft = drafter.draft_pass() if drafter is not None else None
  if draft is not None:
    timers["draft"] = forward_timer(draft.config, draft.params, 1, batch_size, cache_len, offset, draft.head,
                                    draft.layers)
  return timers


def candidate_passes(target_config: ModelConfig, target_params, drafter, candidates: tuple[Any, ...], batch_size: int,
                     cache_len: int, offset: int, repeats: int = 5) -> np.ndarray:
  """The passes a round of each candidate (`k_policy.Candidate`) runs, each timed alone at `offset`
  cached positions: the target's verify pass over the candidate's nodes (`Candidate.nodes`) plus
  `drafter.passes(length)` draft passes (`Drafter.draft_pass`, 1 token): [C] seconds. A tree's levels
  and a parallel draft's block are priced at one 1-token draft pass each (a wider pass costs a little
  more on a CPU)."""
  widths = sorted({c.nodes(drafter.tree) for c in candidates})
  seconds = interleaved_medians(
      pass_timers(target_config, target_params, drafter, widths, batch_size, cache_len, offset), repeats)
  draft_s = seconds.pop("draft", 0.0)
  return np.asarray([seconds[c.nodes(drafter.tree)] + drafter.passes(c.length) * draft_s for c in candidates])


def cost_ratio(target_config: ModelConfig, target_params, draft: DraftPass, batch_size: int, repeats: int,
               cache_len: int = 256, offset: int = 100) -> float:
  """c = the median over `repeats` back-to-back pairs of (seconds of a 1-token draft forward) / (seconds
  of a 1-token target forward), at `batch_size` rows. The draft pass runs through its `head` when given
  and through its blocks `layers` only when given (a layer-skip draft is the target's own subset).
  Pairing cancels the machine's drift, which on a shared VM moves single timings by more than c's own
  spread."""
  draft_timed = forward_timer(draft.config, draft.params, 1, batch_size, cache_len, offset, draft.head, draft.layers)
  target_timed = forward_timer(target_config, target_params, 1, batch_size, cache_len, offset, None)
  return float(np.median([draft_timed() / target_timed() for _ in range(repeats)]))


def drafter_cost_ratio(drafter, target, batch_size: int, repeats: int) -> float:
  """A drafter's c: one draft pass's time over one target pass's (`cost_ratio`), from what the drafter
  says a pass runs (`Drafter.draft_pass`); 0 for a lookup that runs no model. `target` is a
  `LoadedModel`."""
  draft = drafter.draft_pass()
  if draft is None:
    return 0.0
  return cost_ratio(target.config, target.params, draft, batch_size, repeats)


def policy_step_seconds(policy: KPolicy, batch_size: int, k: int, tree: Any = None, steps: int = 2000) -> float:
  """Seconds of one round's K-policy work (`KPolicy.choose` then `update`, as the loop runs them) at
  `batch_size` rows (and a drafter's static `tree`: its spine candidates): a jitted loop of `steps`
  rounds on moving estimates, timed after a compiling call, divided by `steps`. Compared with a
  round's measured cost, it is the policy's overhead."""
  candidates, rows = policy.candidates(k, tree), policy.rows(k, tree)

  @jax.jit
  def rounds(state: k_policy.PolicyState) -> k_policy.PolicyState:
    def one(i, state):
      live_B = (jnp.arange(batch_size) + i) % 5 != 0
      plan, index = policy.choose(state, live_B, candidates)
      wanted_B = plan.clip(jnp.full((batch_size,), k, jnp.int32))
      accepted_AxB = (jnp.arange(rows)[:, None] + jnp.arange(batch_size) * 7 + i) % (k + 1)
      return policy.update(state, index, jnp.broadcast_to(wanted_B, (rows, batch_size)),
                           jnp.minimum(accepted_AxB, wanted_B), live_B)

    return jax.lax.fori_loop(0, steps, one, state)

  state = policy.init(batch_size, candidates,
                      k_policy.Tables(np.linspace(1.0, 2.0, len(candidates)), np.full((rows, k), policy.prior)))
  jax.block_until_ready(rounds(state))
  start = time.perf_counter()
  jax.block_until_ready(rounds(state))
  return (time.perf_counter() - start) / steps
