"""Where a decode's time goes: its calls split into prefill, first round and steady rounds, each round set
beside the passes it runs timed alone (`config.profile`; `python -m specjax.decode --config=...
--config.profile=True`).

Per batch the profiler times, beside the timed call itself, the same compiled program on the same batch
with a budget of one token (its prefill of both models and its first token, no round) and, speculative,
stopped after one round: a call's first round is set apart, because it may do what no later round does
(a draft that defers its prompt, `ModelDrafter.max_lag` None, feeds it there). After the run it times
alone, interleaved, at the batch's mid-generation cache offset: the target's pass over each verify width
the rounds chose, one draft pass (`Drafter.draft_pass`), the target's and the draft's prefill, and the
round's sampling and acceptance rule on [B, K + 1, V] logits. The report, per steady round:

  round_s          (the calls' time - their 1-round calls' time) / (rounds - calls): what a round cost
  passes_s         the target's verify passes (each round at its chosen candidate's nodes; K + 1 for the
                   fixed policy) plus the draft passes the steady rounds ran (`draft_calls`) over them
  acceptance_s     the target's sampling and the acceptance rule alone
  rest_s           round_s - passes_s - acceptance_s: catch-up beyond one-token draft passes, cache and
                   buffer bookkeeping, the policy, the loop's carries
  round_over_passes  round_s / passes_s (an autoregressive step: its step over one 1-token forward)

and prefill_s, first_round_s (the 1-round calls less the prefill calls, per call), rounds, the calls'
seconds, so that prefill_s + calls x first_round_s + (rounds - calls) x round_s is the calls' time
(autoregressive: no first round set apart, prefill_s + rounds x round_s). The passes alone are what the
adaptive policy prices a round from (`k_policy.Prices`); a large rest_s is time no pass explains. Verify
widths are priced at the chosen candidate's: a lookup's rounds that run a narrower pass (short offers)
make passes_s an upper bound.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import costs
from specjax.sampling import argmax_tokens, probabilities
from specjax.speculative import acceptance
from specjax.speculative.proposal import Proposal

REPEATS = 5  # interleaved timings per pass (`costs.interleaved_medians`)


def acceptance_timer(batch: int, k: int, vocab: int, sampling) -> Callable[[], float]:
  """A timer of one round's sampling and acceptance alone: the target's distributions (or argmaxes,
  greedy) of [B, K + 1, V] logits and the acceptance rule over a K-token proposal with draft
  distributions (compiled and run once)."""
  keys = jax.random.split(jax.random.key(0), 3)
  logits_BxK1xV = jax.random.normal(keys[0], (batch, k + 1, vocab), jnp.float32)
  draft_probs_BxKxV = jax.nn.softmax(jax.random.normal(keys[1], (batch, k, vocab), jnp.float32), axis=-1)
  proposal = Proposal(tokens=jnp.argmax(draft_probs_BxKxV, -1).astype(jnp.int32), lengths=jnp.full(
      (batch,), k, jnp.int32), probs=None if sampling.greedy else draft_probs_BxKxV)

  @jax.jit
  def rule(key, proposal, logits_BxK1xV):
    if sampling.greedy:
      return acceptance.verify_greedy(proposal, argmax_tokens(logits_BxK1xV, sampling))
    return acceptance.verify(key, proposal, probabilities(logits_BxK1xV, sampling))

  jax.block_until_ready(rule(keys[2], proposal, logits_BxK1xV))

  def timed() -> float:
    start = time.perf_counter()
    jax.block_until_ready(rule(keys[2], proposal, logits_BxK1xV))
    return time.perf_counter() - start

  return timed


@dataclasses.dataclass
class Profiler:
  """Collects a run's calls (`batch`) and reports where their time went (`report`)."""

  calls_s: float = 0.0  # the timed calls
  prefill_s: float = 0.0  # the same calls with a budget of one token
  first_calls_s: float = 0.0  # the same calls stopped after one round (speculative; else the prefill calls)
  calls: int = 0
  rounds: int = 0  # rounds run (autoregressive: steps after the first token)
  draft_calls: int = 0  # draft passes run, the first rounds' excluded
  rounds_per_candidate: Any = 0  # [C] (speculative)
  generated: int = 0  # tokens per row, summed (for the passes' cache offset)
  rows: int = 0

  def batch(self, session, batch, key, out, wall: float) -> None:
    """Adds a timed call of `session` (`specjax.session.Session`) on `batch` (`out`, `wall` seconds) and
    times its batch's prefill call and 1-round call (the first batch's after one untimed run of each: a
    program's first execution prepares its kernels lazily)."""
    def timed(call) -> tuple[float, object]:
      if not self.rows:
        jax.block_until_ready(call().tokens)
      start = time.perf_counter()
      result = jax.block_until_ready(call())
      return time.perf_counter() - start, result

    prefill_s, _ = timed(lambda: session(batch.with_budget(1), key, learn=False))
    self.prefill_s += prefill_s
    self.calls_s += wall
    self.calls += 1
    self.rounds += int(out.target_calls) - 1
    if session.drafter is None:
      self.first_calls_s += prefill_s
    else:
      first_s, first = timed(lambda: session(batch, key, 1, learn=False))
      self.first_calls_s += first_s
      self.draft_calls += int(out.draft_calls) - int(first.draft_calls)
      self.rounds_per_candidate = (self.rounds_per_candidate + np.asarray(out.rounds_per_length) -
                                   np.asarray(first.rounds_per_length))
    self.generated += int(np.sum(np.asarray(out.counts)))
    self.rows += len(batch.lengths_B)

  def report(self, session, width: int) -> dict[str, Any]:
    """The profile (the module docstring), its passes timed alone now (`session`: the run's; `width`: its
    padded prompt width)."""
    spec, target, drafter = session.spec, session.target, session.drafter
    batch = spec.config.batch_size
    offset = min(width + self.generated // max(self.rows, 1) // 2, session.cache_len - spec.verify_width)
    candidates = session.candidates if drafter is not None else ()
    widths = sorted({1} | {c.nodes(drafter.tree) for c in candidates})
    timers = costs.pass_timers(target.config, target.params, drafter, widths, batch, session.cache_len, offset)
    timers["target prefill"] = costs.forward_timer(target.config, target.params, width, batch, session.cache_len, 0,
                                                   None)
    draft = drafter.draft_pass() if drafter is not None else None
    if draft is not None:
      timers["draft prefill"] = costs.forward_timer(draft.config, draft.params, width, batch, session.cache_len, 0,
                                                    draft.head, draft.layers)
    if drafter is not None:
      timers["acceptance"] = acceptance_timer(batch, spec.k, target.config.vocab_size, spec.sampling)
    seconds = costs.interleaved_medians(timers, REPEATS)
    first_apart = drafter is not None
    rounds = max(self.rounds - (self.calls if first_apart else 0), 1)
    if drafter is None:
      verify_s, draft_s, acceptance_s = seconds[1], 0.0, 0.0
    else:
      per_candidate = np.asarray(self.rounds_per_candidate, np.float64)
      verify_s = float(sum(n * seconds[c.nodes(drafter.tree)] for n, c in zip(per_candidate, candidates))) / rounds
      draft_s = self.draft_calls * seconds.get("draft", 0.0) / rounds
      acceptance_s = seconds["acceptance"]
    round_s = (self.calls_s - self.first_calls_s) / rounds
    passes_s = verify_s + draft_s
    first_round_s = (self.first_calls_s - self.prefill_s) / max(self.calls, 1) if first_apart else None
    return {
        "calls_s": self.calls_s, "prefill_s": self.prefill_s, "first_round_s": first_round_s, "rounds": self.rounds,
        "calls": self.calls, "round_s": round_s, "passes_s": passes_s, "verify_pass_s": verify_s,
        "draft_passes_s": draft_s, "draft_passes_per_round": self.draft_calls / rounds, "acceptance_s": acceptance_s,
        "rest_s": round_s - passes_s - acceptance_s, "round_over_passes": round_s / passes_s,
        "passes_alone_s": {str(name): s for name, s in seconds.items()}, "cache_offset": offset
    }


def lines(profile: dict[str, Any]) -> list[str]:
  """The profile as printed lines: the sum of the passes beside the measured round."""
  ms = lambda s: f"{1e3 * s:.1f} ms"  # noqa: E731
  alone = ", ".join(f"{name}: {ms(s)}" for name, s in profile["passes_alone_s"].items())
  first = profile.get("first_round_s")
  return [
      f"profile: {profile['rounds']} rounds in {profile['calls_s']:.2f} s of calls, {profile['prefill_s']:.2f} s "
      f"of them prefill" + ("" if first is None else f", each call's first round {ms(first)}"),
      f"  a{'' if first is None else ' later'} round {ms(profile['round_s'])} = passes {ms(profile['passes_s'])} "
      f"(verify {ms(profile['verify_pass_s'])}"
      f" + {profile['draft_passes_per_round']:.2f} draft passes {ms(profile['draft_passes_s'])}) + acceptance "
      f"{ms(profile['acceptance_s'])} + rest {ms(profile['rest_s'])}: "
      f"{profile['round_over_passes']:.2f}x its passes",
      f"  passes alone at {profile['cache_offset']} cached positions: {alone}"
  ]
