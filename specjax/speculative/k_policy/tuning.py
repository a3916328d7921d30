"""The K policy's tuning on the host: what a decoder keeps between calls of one compiled program (`Memory`:
the measured cost table and the acceptance observed), the cost table's measurement with the program
itself (`calibrate`), stored per machine and program (`cost_store`), and the policy's record in a run's
results (`tune`, `record`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from specjax.speculative.k_policy import cost_store
from specjax.speculative.k_policy.policy import Candidate, KPolicy


@dataclasses.dataclass(frozen=True)
class Tuning:
  """How a decoder measures the adaptive policy's cost table (config.adaptive's host-side fields)."""

  calibration_rounds: int = 3  # rounds timed per candidate (`calibrate`)
  reuse_costs: bool = True  # reuse the table this machine stored for the same program (`cost_store`)

  @classmethod
  def parse(cls, calibration_rounds: int, reuse_costs: bool) -> "Tuning":
    """The settings, or a ValueError naming the field."""
    if int(calibration_rounds) != calibration_rounds or calibration_rounds < 1:
      raise ValueError(f"adaptive.calibration_rounds must be an integer >= 1, got {calibration_rounds}")
    return cls(int(calibration_rounds), bool(reuse_costs))


# The weight, in rounds, of a position's base (the prior for the first position, the estimate of the one
# before it for the others) against the rounds a decoder observed there (`Memory.prior_AxK`).
PRIOR_ROUNDS = 8.0
# The rounds per position a decoder remembers: older observations are scaled down to this many, so the
# prior follows traffic that changes.
MEMORY_ROUNDS = 256.0


@dataclasses.dataclass
class Memory:
  """What a decoder keeps between calls of one compiled program: the measured cost table [C] (None until
  `calibrate` ran) and, per estimate a (`KPolicy.rows`), the rounds that reached and accepted each draft
  position, summed over its calls' rows (calibration's forced rounds included: `PolicyState`'s
  counts), from which the next call's prior comes (`prior_AxK`)."""

  prior: float  # `KPolicy.prior`: the first position's acceptance before any observation
  k: int
  rows: int = 1  # A
  cost_C: np.ndarray | None = None
  reached_AxK: np.ndarray | None = None  # [A, K] float64 (zeros when not given)
  accepted_AxK: np.ndarray | None = None  # [A, K] float64
  prefill_s: float = 0.0  # seconds of a call before its rounds (`Prices.prefill_s`; 0 when not measured)
  catch_up_s: float = 0.0  # what a call's first drafting round costs beyond a steady one (`Prices.catch_up_s`)
  stale: bool = False  # a call missed the table's prediction (`check`): the next `tune` measures it again

  def __post_init__(self):
    self.reached_AxK = np.zeros((self.rows, self.k)) if self.reached_AxK is None else self.reached_AxK
    self.accepted_AxK = np.zeros((self.rows, self.k)) if self.accepted_AxK is None else self.accepted_AxK

  @property
  def prior_AxK(self) -> np.ndarray:
    """[A, K] float32: position j's observed rate shrunk toward a base by PRIOR_ROUNDS pseudo-rounds,
    (PRIOR_ROUNDS * base_j + accepted_j) / (PRIOR_ROUNDS + reached_j), the base being `prior` for the
    first position and the estimate of position j - 1 for the others: a position seldom reached (deep
    ones: only long proposals reach them) is assumed to accept like the one before it, not like a
    constant. Kept inside [0.01, 0.99] (never written off nor taken for granted)."""
    prior_AxK = np.zeros((self.rows, self.k), np.float32)
    for a in range(self.rows):
      base = self.prior
      for j in range(self.k):
        base = float(
            np.clip((PRIOR_ROUNDS * base + self.accepted_AxK[a, j]) / (PRIOR_ROUNDS + self.reached_AxK[a, j]), 0.01,
                    0.99))
        prior_AxK[a, j] = base
    return prior_AxK

  def learn(self, reached_AxK: np.ndarray, accepted_AxK: np.ndarray) -> None:
    """Adds a call's rounds that reached each position and those that accepted it (summed over rows);
    a position observed more than MEMORY_ROUNDS times keeps that many, in proportion."""
    self.reached_AxK = self.reached_AxK + reached_AxK
    self.accepted_AxK = self.accepted_AxK + accepted_AxK
    scale_AxK = np.minimum(1.0, MEMORY_ROUNDS / np.maximum(self.reached_AxK, 1.0))
    self.reached_AxK, self.accepted_AxK = self.reached_AxK * scale_AxK, self.accepted_AxK * scale_AxK

  def check(self, rounds_C: np.ndarray, measured_s: float, drafted: bool) -> dict[str, Any] | None:
    """Holds the table against a call that ran `rounds_C` [C] rounds at each candidate in `measured_s`
    seconds, `drafted` when some round drafted: predicted, the prefill, the first drafting round's
    catch-up when one ran, and each round's cost. A miss by more than MISS_LIMIT of the prediction
    marks the table stale (the next `tune` measures it again); the record says so. None when nothing
    is tuned, or when the rounds are predicted to last under MIN_CHECKED_S (too short to tell a wrong
    table from a call's jitter)."""
    if self.cost_C is None:
      return None
    rounds_s = float(np.dot(np.asarray(rounds_C, np.float64), np.asarray(self.cost_C, np.float64)))
    if rounds_s < MIN_CHECKED_S:
      return None
    predicted = self.prefill_s + (self.catch_up_s if drafted else 0.0) + rounds_s
    miss = measured_s / predicted - 1.0
    stale = abs(miss) > MISS_LIMIT
    self.stale = self.stale or stale
    return {"predicted_s": predicted, "measured_s": measured_s, "miss": miss, "stale": stale}


def forcing(num_candidates: int, index: int) -> np.ndarray:
  """A cost table under which the adaptive policy always chooses candidate `index` (for `calibrate`)."""
  return np.where(np.arange(num_candidates) == index, 1.0, 1e30).astype(np.float32)


# The least time the timed rounds of one calibration length must take: a round of a small model on a
# fast device lasts milliseconds, and a few of them drown in a call's own jitter. At most MAX_EXTENSIONS
# longer calls per length reach for it.
MIN_TIMED_S = 0.5
MAX_EXTENSIONS = 2


class Forced(NamedTuple):
  """Forced rounds of one candidate, timed (`forced_round_seconds`)."""

  round_s: float  # seconds of a steady round
  first_call_s: float  # seconds of the 1-round call: the prefill, the first token and the first round


def forced_round_seconds(num_candidates: int, index: int, run: Callable[[np.ndarray, int], int],
                         rounds: int = 3) -> Forced:
  """Seconds per round of the compiled program forced to candidate `index` of `num_candidates`, and of
  its 1-round call:
  `run(cost_C, round_limit)` decodes one batch (blocking until done) with the policy forced by `cost_C`
  and at most `round_limit` rounds, and returns the rounds it ran. One untimed round first (the first
  execution of a program's branch is several times slower on a CPU: kernels are prepared lazily), then
  a 1-round call and a (1 + n)-round call, whose difference over the rounds between them is the cost:
  the prefill, the first token and the first round cancel within the same length. n starts at `rounds`
  and grows until the difference lasts MIN_TIMED_S (or the budget ends the call first, or
  MAX_EXTENSIONS longer calls were made)."""
  def timed(cost_C: np.ndarray, limit: int) -> tuple[float, int]:
    start = time.perf_counter()
    ran = run(cost_C, limit)
    return time.perf_counter() - start, ran

  forced = forcing(num_candidates, index)
  run(forced, 1)
  short_s, short_rounds = timed(forced, 1)
  asked = rounds
  for _ in range(MAX_EXTENSIONS + 1):
    long_s, long_rounds = timed(forced, 1 + asked)
    seconds, ran = max(long_s - short_s, 1e-6), max(long_rounds - short_rounds, 1)
    if seconds >= MIN_TIMED_S or long_rounds < 1 + asked:
      break
    asked = max(asked + 1, int(np.ceil(1.2 * MIN_TIMED_S / (seconds / ran))))
  return Forced(seconds / ran, short_s)


def monotone(candidates: tuple[Candidate, ...], cost_C: np.ndarray) -> np.ndarray:
  """The table with every candidate costing at least what each candidate it covers costs
  (`Candidate.covers`: it does what that one does, and more), so a measured dip, which is noise, is
  lifted."""
  cost_C = np.array(cost_C, np.float32)
  for index, candidate in enumerate(candidates):  # those it covers come earlier: already lifted
    cost_C[index] = max([cost_C[index]] +
                        [cost_C[j] for j, other in enumerate(candidates[:index]) if candidate.covers(other)])
  return cost_C


def calibrate(candidates: tuple[Candidate, ...], run: Callable[[np.ndarray, int], int], rounds: int = 3) -> np.ndarray:
  """The cost table [C] timed as whole forced rounds of the compiled program (`forced_round_seconds`
  per candidate), made monotone. A decoder prices its table instead (`Prices`: passes timed alone plus
  one measured overhead), which measures more stably on a shared CPU; this direct measurement serves
  where the models' passes are not at hand (experiments/benchmark_accelerator.py)."""
  return monotone(
      candidates,
      np.asarray([
          forced_round_seconds(len(candidates), index, run, rounds).round_s for index in range(len(candidates))
      ], np.float32))


# A stored or measured table whose prediction of a call misses the call's measured time by more than this
# share is measured again (`Memory.check`); calls whose rounds are predicted to last under
# MIN_CHECKED_S are not checked (a small model's calls: their jitter is larger than the rounds).
MISS_LIMIT = 0.25
MIN_CHECKED_S = 1.0


@dataclasses.dataclass(frozen=True)
class Prices:
  """A round's cost built from what measures stably (the adaptive policy's cost table): the passes a
  round runs, each timed alone as a jitted forward (its verify pass over its nodes, and its draft
  passes: `Drafter.passes`), plus what a round costs beyond its passes, measured once on plain rounds
  of the compiled program (sampling, bookkeeping, a lookup's search: a plain round's time less its
  1-token pass). Whole forced rounds of every length, timed on a shared 2-core VM, inherit lazy first
  executions and drift (such tables were 2-4x off the rounds run, and two of them disagreed); passes
  timed alone, interleaved, measure stably."""

  passes_C: np.ndarray  # [C] seconds of each candidate's passes, timed alone
  overhead_s: float  # seconds a round costs beyond its passes
  prefill_s: float  # seconds of a call that only prefills and draws its first token (`Memory.check`)
  forced_longest_s: float | None = None  # the longest candidate's rounds timed whole (`forced_round_seconds`): a check
  catch_up_s: float = 0.0  # what a call's first drafting round costs beyond a steady one (`measured`)

  @classmethod
  def measured(cls, passes_C: np.ndarray, plain: Forced, longest: Forced, prefill_s: float) -> Prices:
    """Prices from the passes and two timings of whole rounds, plain and at the longest candidate: each,
    less its passes, measures what a round costs beyond them, and the overhead is the smaller (>= 0). A
    longer round does at least a plain round's bookkeeping, so a plain excess above the longest's is not
    the program's: the plain rounds are timed first, and in a fresh process the first program's ran
    42-68 ms over their pass (an int4 draft, a 2-core Xeon) while its K = 5 rounds stayed near theirs.
    The longest candidate's 1-round call, less the prefill and a steady round, is the first drafting
    round's catch-up (>= 0): a draft that defers its prompt (`ModelDrafter.max_lag` None) feeds it
    there, 0.3-0.4 s on the README prompts (0.5B draft, bfloat16), which no steady round pays."""
    excess_s = min(plain.round_s - float(passes_C[0]), longest.round_s - float(passes_C[-1]))
    catch_up_s = max(longest.first_call_s - prefill_s - longest.round_s, 0.0)
    return cls(passes_C, max(excess_s, 0.0), prefill_s, longest.round_s, catch_up_s)

  @property
  def longest_miss(self) -> float | None:
    """How far the priced longest candidate lies from its rounds timed whole (their ratio less 1)."""
    return None if self.forced_longest_s is None else self.forced_longest_s / float(self.cost_C[-1]) - 1.0

  @property
  def cost_C(self) -> np.ndarray:
    """[C] float32 seconds of a round at each candidate."""
    return (np.asarray(self.passes_C, np.float64) + self.overhead_s).astype(np.float32)


def record(policy: KPolicy, candidates: tuple[Candidate, ...]) -> dict[str, Any]:
  """The policy's record for a run's results: its kind and candidates (a tree's: which verify a spine)."""
  entry = {"kind": policy.kind, "lengths": [c.length for c in candidates]}
  if any(c.spine for c in candidates):
    entry["spine"] = [c.spine for c in candidates]
  return entry


def tune(memory: Memory, tuning: Tuning, description: dict[str, Any], candidates: tuple[Candidate, ...],
         measure: Callable[[int], Prices], log: Callable[[str], None]) -> dict[str, Any]:
  """Gives `memory` its cost table, unless it holds one: the one stored for the program's `description`
  on this machine (`cost_store`; its calibration's acceptance learned too: this run starts where that
  one did), else measured by `measure(rounds)` (the program's passes and its plain rounds: `Prices`)
  and stored. A table a call found stale (`Memory.check`) is measured again, the stored one
  replaced. Returns what the results record of it (the cost table and how it was built, what
  measuring it took, the acceptance prior the timed calls start from)."""
  seconds, stored_at, prices, remeasured = 0.0, None, None, memory.stale
  description = {"machine": cost_store.machine(), **description}
  if memory.cost_C is None or memory.stale:
    memory.cost_C, memory.stale = None, False
    # Several processes must all measure or all reuse (calibrating runs the program, collectives
    # included): their disks may differ, so only a single process stores and reuses tables.
    stores = jax.process_count() == 1
    if tuning.reuse_costs and stores and not remeasured:
      stored, note = cost_store.load(description, candidates, memory.reached_AxK.shape)
      if stored is not None:
        memory.cost_C, memory.prefill_s, stored_at = stored.cost_C, stored.prefill_s, stored.measured_at
        memory.catch_up_s = stored.catch_up_s
        memory.learn(stored.reached_AxK, stored.accepted_AxK)
        log(f"reusing the round costs this machine measured for this program at {stored_at} "
            f"(config.adaptive.reuse_costs=False measures them again)")
      elif note:
        log(note)
    if memory.cost_C is None:
      names = [c.label for c in candidates]
      why = f"a call missed the round costs by over {MISS_LIMIT:.0%}: " if remeasured else ""
      log(f"{why}measuring the adaptive policy's round costs at {', '.join(names)} ...")
      start = time.perf_counter()
      prices = measure(tuning.calibration_rounds)
      memory.cost_C, memory.prefill_s = monotone(candidates, prices.cost_C), prices.prefill_s
      memory.catch_up_s = prices.catch_up_s
      seconds = time.perf_counter() - start
      if stores:
        cost_store.save(description, candidates, memory.cost_C, seconds, memory.reached_AxK, memory.accepted_AxK,
                        memory.prefill_s, memory.catch_up_s)
  cost_C, prior_AxK = memory.cost_C, memory.prior_AxK
  log(f"round cost by proposal length: "
      f"{', '.join(f'{c.label}: {1e3 * cost:.1f} ms' for c, cost in zip(candidates, cost_C))}"
      f"; acceptance prior by position: {' '.join(f'{a:.2f}' for a in prior_AxK[0])}" +
      (f" (spine: {' '.join(f'{a:.2f}' for a in prior_AxK[1])})" if len(prior_AxK) > 1 else ""))
  entry = {
      "cost_table_s": [float(c) for c in cost_C], "calibration_time_s": seconds, "cost_table_measured_at": stored_at,
      "acceptance_prior": [float(a) for a in prior_AxK[0]], "prefill_s": memory.prefill_s,
      "catch_up_s": memory.catch_up_s, "remeasured_after_a_miss": remeasured
  }
  if prices is not None:
    entry.update(passes_s=[float(p) for p in prices.passes_C], round_overhead_s=prices.overhead_s,
                 forced_longest_round_s=prices.forced_longest_s, forced_longest_miss=prices.longest_miss)
  if len(prior_AxK) > 1:
    entry["spine_acceptance_prior"] = [float(a) for a in prior_AxK[1]]
  return entry


def nodes_verified_per_round(tree: Any, nodes: int, policy: dict[str, Any]) -> float:
  """The nodes a round verified on average, the pending token included, from a run's policy record: a
  static tree's chosen candidate each round (its cut at a depth, or that cut's spine; all N + 1 nodes
  under the fixed policy), a dynamic tree's N + 1 (`tree`: the drafter's)."""
  rounds = sum(policy["rounds_per_length"])
  if not rounds:
    return nodes + 1
  spine = policy.get("spine") or [False] * len(policy["lengths"])
  return sum(n * Candidate(length, s).nodes(tree)
             for n, length, s in zip(policy["rounds_per_length"], policy["lengths"], spine)) / rounds


def cost_table_source(policy: dict[str, Any]) -> str:
  """Where an adaptive run's cost table came from (`tune`'s record), for printing: "measured in 54.1 s"
  now, or "stored, measured at <when>" by an earlier run."""
  if policy.get("cost_table_measured_at"):
    return f"stored, measured at {policy['cost_table_measured_at']}"
  return f"measured in {policy['calibration_time_s']:.1f} s"
