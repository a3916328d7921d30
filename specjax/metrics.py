"""Acceptance statistics of speculative decoding and the theory they are compared with.

`AcceptanceCounts` holds per-row counters that the jitted loop updates every round (`record`);
`summarize` turns them into a JSON-ready dict on the host. Everything else is derived from three
counters, so the loop carries no redundant state:
  a draft position i is reached in a round that proposed at least i tokens and accepted positions
  1 .. i-1; each reached position is either accepted or the round's one rejection, so
  rejections = sum_i (reached_i - accepted_i). Rows may propose fewer than K tokens in a round (an
  n-gram drafter without a match, an early-stopped draft), so `proposed` is counted, not K * rounds.
The theory is Leviathan et al. (2023): with an i.i.d. per-token acceptance probability alpha, a round
emits (1 - alpha^(K+1)) / (1 - alpha) tokens on average, and with a draft pass costing c target
passes the speedup over autoregressive decoding is that divided by (K c + 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import mesh as meshes


@flax.struct.dataclass
class AcceptanceCounts:
  rounds: jax.Array  # [B] int32: verify rounds (target passes after the prefill) while the row was live
  proposed: jax.Array  # [B] int32: draft tokens proposed, summed over those rounds
  accepted: jax.Array  # [B] int32: draft tokens accepted, summed over those rounds
  reached_at: jax.Array  # [B, K] int32: rounds in which draft position i + 1 was proposed and reached
  accepted_at: jax.Array  # [B, K] int32: rounds in which draft position i + 1 was accepted
  forced: jax.Array  # [B] int32: generated tokens a constraint forced (its state allowed only them: jump-forward)


def zero_counts(batch_size: int, k: int) -> AcceptanceCounts:
  zeros_B, zeros_BxK = jnp.zeros((batch_size,), jnp.int32), jnp.zeros((batch_size, k), jnp.int32)
  return AcceptanceCounts(rounds=zeros_B, proposed=zeros_B, accepted=zeros_B, reached_at=zeros_BxK,
                          accepted_at=zeros_BxK, forced=zeros_B)


def reached_and_accepted(num_accepted_B: jax.Array, num_proposed_B: jax.Array, live_B: jax.Array,
                         k: int) -> tuple[jax.Array, jax.Array]:
  """([B, K] draft positions each live row's round reached, [B, K] those it accepted): position i + 1
  is reached when proposed and positions 1 .. i were accepted (jittable)."""
  position_1xK = jnp.arange(k)[None, :]
  accepted_BxK = live_B[:, None] & (position_1xK < num_accepted_B[:, None])
  reached_BxK = (live_B[:, None] & (position_1xK <= num_accepted_B[:, None]) & (position_1xK < num_proposed_B[:, None]))
  return reached_BxK, accepted_BxK


def record(counts: AcceptanceCounts, num_accepted_B: jax.Array, num_proposed_B: jax.Array, live_B: jax.Array,
           forced_B: jax.Array) -> AcceptanceCounts:
  """Adds one round in which each live row proposed `num_proposed_B[b]` draft tokens, accepted the
  first `num_accepted_B[b]` of them and generated `forced_B[b]` forced tokens (jittable)."""
  reached_BxK, accepted_BxK = reached_and_accepted(num_accepted_B, num_proposed_B, live_B, counts.accepted_at.shape[1])
  return AcceptanceCounts(rounds=counts.rounds + live_B,
                          proposed=counts.proposed + jnp.where(live_B, num_proposed_B, 0),
                          accepted=counts.accepted + jnp.where(live_B, num_accepted_B, 0),
                          reached_at=counts.reached_at + reached_BxK, accepted_at=counts.accepted_at + accepted_BxK,
                          forced=counts.forced + jnp.where(live_B, forced_B, 0))


def _ratio(numerator: float, denominator: float) -> float | None:
  return float(numerator) / float(denominator) if denominator else None


def _summary(rounds: int, proposed: int, accepted: int, reached_K: np.ndarray, accepted_at_K: np.ndarray,
             forced: int) -> dict:
  """The statistics of one row, or of all rows when given their sums."""
  rejections = int((reached_K - accepted_at_K).sum())
  return {
      "rounds": int(rounds),
      "proposed": int(proposed),
      "accepted": int(accepted),
      "rejections": rejections,
      "acceptance_rate": _ratio(accepted, proposed),  # accepted / proposed
      "alpha_hat": _ratio(accepted, accepted + rejections),  # per-token acceptance estimate
      "mean_accepted_length": _ratio(accepted + rounds, rounds),  # tokens per verify round
      "accepted_at_position": [int(a) for a in accepted_at_K],
      "reached_at_position": [int(r) for r in reached_K],
      "position_acceptance_rate": [_ratio(a, r) for a, r in zip(accepted_at_K, reached_K)],
      "jump_forward": int(forced),  # generated tokens a constraint forced (the first one included)
  }


def summarize(counts: AcceptanceCounts) -> dict:
  """Host-side summary for JSON: `total` over all rows and `per_row`.

  Each holds rounds, proposed, accepted and rejections, the acceptance rate (accepted / proposed),
  alpha_hat = accepted / (accepted + rejections) (the maximum-likelihood per-token acceptance
  probability under the i.i.d. model of the theory), the mean accepted length (tokens emitted per
  verify round, the bonus or residual token included: block efficiency, before EOS or budget cuts),
  per draft position how often it was accepted and reached, and the tokens a constraint forced
  (`jump_forward`). Ratios with a zero denominator are None.
  """
  arrays = [
      np.asarray(a)
      for a in (counts.rounds, counts.proposed, counts.accepted, counts.reached_at, counts.accepted_at, counts.forced)
  ]
  return {"total": _summary(*(a.sum(axis=0) for a in arrays)), "per_row": [_summary(*row) for row in zip(*arrays)]}


def _check_theory_args(alpha: float, k: int) -> None:
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"alpha must be in [0, 1], got {alpha}")
  if int(k) != k or k < 1:
    raise ValueError(f"k must be an integer >= 1, got {k}")


def expected_accepted_length(alpha: float, k: int) -> float:
  """Expected tokens per verify round, (1 - alpha^(K+1)) / (1 - alpha) = sum_{i=0..K} alpha^i
  (the sum form is exact at alpha = 1, where it is K + 1)."""
  _check_theory_args(alpha, k)
  return float(sum(alpha**i for i in range(int(k) + 1)))


def theoretical_speedup(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
  """Leviathan et al.'s expected walltime improvement (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)),
  with c the cost of one draft pass relative to one target pass.

  `verify_cost` generalizes the 1 in the denominator: the cost of the (K+1)-token verify pass in
  target steps. The paper assumes 1 (true where a step is memory-bound at any small T, e.g. GPUs); where
  a wider pass costs more (a CPU, past the rows its matmul tiles carry at once), pass the measured ratio
  (verify pass time / one-token step time) to make the formula a cost model of the actual loop."""
  if c < 0:
    raise ValueError(f"cost ratio c must be >= 0, got {c}")
  if verify_cost <= 0:
    raise ValueError(f"verify_cost must be > 0, got {verify_cost}")
  return expected_accepted_length(alpha, k) / (k * c + verify_cost)


@dataclasses.dataclass
class Tally:
  """What a run's batches add up to: tokens, wall time, passes and acceptance (per turn, or merged)."""

  tokens: int = 0
  walls: list[float] = dataclasses.field(default_factory=list)  # seconds per batch
  target_calls: int = 0
  draft_calls: int = 0
  acceptance: list = dataclasses.field(default_factory=list)  # per batch: `metrics` counters of its real rows
  rounds_per_length: Any = 0  # [C] rounds that chose each proposal length (speculative)

  def add(self, speculative: bool, out, wall: float, counts_B: np.ndarray) -> list[dict] | None:
    """Counts one batch's output, whose real rows (the first ones; the rest are filler) generated `counts_B` tokens;
    returns the real rows' statistics (speculative)."""
    rows = len(counts_B)
    self.tokens += int(np.sum(counts_B))
    self.walls.append(wall)
    self.target_calls += int(out.target_calls)
    if not speculative:
      return None
    self.draft_calls += int(out.draft_calls)
    self.rounds_per_length = self.rounds_per_length + meshes.to_host(out.rounds_per_length)
    self.acceptance.append(jax.tree.map(lambda a: a[:rows], meshes.to_host(out.acceptance)))
    return summarize(self.acceptance[-1])["per_row"]

  @staticmethod
  def merged(tallies: Sequence["Tally"]) -> Tally:
    return Tally(sum(t.tokens for t in tallies), [w for t in tallies for w in t.walls],
                 sum(t.target_calls for t in tallies), sum(t.draft_calls for t in tallies),
                 [a for t in tallies for a in t.acceptance], sum(t.rounds_per_length for t in tallies))

  def stats(self, speculative: bool) -> dict[str, Any]:
    wall = sum(self.walls)
    stats = {
        "generated_tokens": self.tokens, "wall_time_s": wall, "tokens_per_second": self.tokens / wall,
        "target_calls": self.target_calls
    }
    if speculative:
      totals = summarize(jax.tree.map(lambda *a: np.concatenate(a), *self.acceptance))["total"]
      stats.update(draft_calls=self.draft_calls, acceptance_rate=totals["acceptance_rate"],
                   alpha_hat=totals["alpha_hat"], mean_accepted_length=totals["mean_accepted_length"],
                   per_position_acceptance=totals["position_acceptance_rate"], acceptance=totals,
                   jump_forward_share=totals["jump_forward"] / max(self.tokens, 1),
                   k_policy={"rounds_per_length": [int(n) for n in self.rounds_per_length]})
    return stats
