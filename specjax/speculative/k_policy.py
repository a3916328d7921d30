"""How many draft tokens a round proposes: the K policy.

`fixed`: every live row proposes K tokens every round (the classic loop). `adaptive`: each round the
policy picks one length L from a small set of candidates (0 = no draft tokens, a plain target step; the
set is `KPolicy.lengths`, each the width of a compiled verify pass minus one) to maximise the batch's
expected committed tokens per second:

  L* = argmax_L  sum_b live_b * (1 + sum_{j=1..L} prod_{i<=j} alpha_b,i) / cost_L

with alpha_b,i the running estimate of row b's conditional acceptance at draft position i (position i
accepted given 1 .. i-1 were) and cost_L the measured seconds of a round at length L (`calibrate`: the
compiled program itself, forced to each length, on the running device). A single L serves the whole
batch because the draft passes and the verify pass are shared: once the batch pays for L, proposing
fewer tokens in some row would only lose tokens.

A static tree (a drafter's `tree`, K its depth Dt) is chosen by depth and width: a candidate
(`Candidate`) is a depth L and either the whole tree cut at L (`Tree.cut`: its nodes no deeper than L)
or only that cut's spine (`Tree.spine`: each node's first-choice child, a chain of L tokens), one
compiled tree pass each. The round drafts the cut at L and verifies the candidate's nodes. Each row
keeps two estimates per depth i (rows a of alpha_b,a,i): a = 0, that some child at depth i is accepted
given its parent was (what the whole cut gains), and a = 1, that the spine's node at depth i is
accepted given the spine's node above it was (what the spine gains; a round of the whole cut observes
it too, along the accepted path's first-choice prefix). The spine wins where the other branches do not
pay for the wider verify pass (a large batch, a slow device, siblings the target seldom takes).
Dynamic trees keep the fixed policy (their shape is drawn each round).

Estimates: every position a row's round reached (proposed, earlier ones accepted) moves toward its
outcome, alpha <- decay * alpha + (1 - decay) * accepted; a position not reached drifts back toward the
prior by `recovery` per round, so a row that stopped drafting tries again once the prior outweighs the
cost (drafting resumes where the text starts repeating). The prior is per position and runtime
(`prior_AxK`): `KPolicy.prior` at first, then the acceptance a decoder measured in its earlier calls of
the same program (`Memory`, calibration's forced rounds included), as a server learns from its
traffic: the first rounds of a call need not relearn what the pair accepts, a pair whose drafts
seldom pay is not sent back to drafting by an optimistic constant, and deep positions that few rounds
reached are assumed to accept like the shallower ones measured, not like the constant.

Exactness: the length is chosen before the round's draft from the outcomes of earlier rounds only, so
given the history it is a fixed number, and the acceptance rule is exact for any proposal length. A
drafter may still stop early from its own draws (`stop_threshold`): a proposal's length then depends on
the draft's randomness, never on the target's distributions of the round being verified, which is what
the rule needs (each accepted/resampled token is drawn exactly given the prefix, whatever decided how
many draft tokens were offered). A spine is a tree too (each node's first child, drawn as in the
whole tree: from the draft's distribution after its path), and the tree rule is exact for any tree
chosen before the round. A policy reading the target's probabilities of the current round
would bias the output; the tests show such a policy failing the exactness test.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import metrics
from specjax.speculative.trees.tree import Tree

KINDS = ("fixed", "adaptive")  # what a compiled program runs
AUTO = "auto"  # config.k_policy's default: adaptive, but fixed for a dynamic tree (`resolve`)


def resolve(kind: str, dynamic_tree: bool) -> str:
  """config.k_policy as the program runs it: "auto" is adaptive (a chain's length, a static tree's depth)
  and fixed for a dynamic tree, whose shape is drawn each round."""
  if kind == AUTO:
    return "fixed" if dynamic_tree else "adaptive"
  return kind


class Candidate(NamedTuple):
  """One shape a round may verify: `length` draft tokens (a tree's depth: its cut at that depth) or, with
  `spine`, only the cut's first-choice path (a chain of `length` tokens: `Tree.spine`)."""

  length: int
  spine: bool = False

  @property
  def row(self) -> int:
    """Which acceptance estimate prices it: 0 = the whole cut's (a chain's), 1 = the spine's."""
    return int(self.spine)

  @property
  def label(self) -> str:
    return f"{self.length} spine" if self.spine else str(self.length)

  def covers(self, other: "Candidate") -> bool:
    """Whether this candidate verifies every node `other` verifies (so it cannot cost less)."""
    return self.length >= other.length and (other.spine or not self.spine or other.length == 0)

  def nodes(self, tree: Tree | None) -> int:
    """The tokens its verify pass scores, the pending one included (`tree` None: a chain)."""
    if tree is None or self.spine:
      return self.length + 1
    return tree.cut(self.length).nodes_with_root


def labels(record: dict) -> list[str]:
  """The candidates' labels of a results record's "lengths" and "spine" lists (`pipeline`)."""
  spine = record.get("spine") or [False] * len(record["lengths"])
  return [Candidate(n, s).label for n, s in zip(record["lengths"], spine)]


@dataclasses.dataclass(frozen=True)
class KPolicy:
  """The policy's static settings (hashable: part of the compiled program)."""

  kind: str = "fixed"  # one of KINDS
  prior: float = 0.8  # every position's acceptance prior until a decoder has measured its own (`Memory`)
  decay: float = 0.9  # weight of the old estimate when a round reaches the position
  recovery: float = 0.02  # drift toward the prior per round in which a position is not reached

  @property
  def adaptive(self) -> bool:
    return self.kind == "adaptive"

  def lengths(self, k: int) -> tuple[int, ...]:
    """The proposal lengths a round may choose (static): K alone when fixed; adaptive: 0 to 3, two
    thirds of K, and K (each one more compiled verify width)."""
    if not self.adaptive:
      return (k,)
    return tuple(sorted({min(n, k) for n in (0, 1, 2, 3)} | {round(2 * k / 3), k}))

  def widths(self, k: int) -> tuple[int, ...]:
    """The verify widths the chosen lengths need: each length plus the pending token."""
    return tuple(n + 1 for n in self.lengths(k))

  def candidates(self, k: int, tree: Any = None) -> tuple[Candidate, ...]:
    """What a round may verify (static), ordered so that a candidate comes after those it covers:
    each of `lengths(k)`; for a static tree (a drafter's `tree`, K its depth) that branches, under the
    adaptive policy, each length's spine before its whole cut (where the cut is not already a chain)."""
    if not self.adaptive or not isinstance(tree, Tree) or tree.is_chain:
      return tuple(Candidate(n) for n in self.lengths(k))
    candidates = []
    for n in self.lengths(k):
      spine = Candidate(len(tree.spine(n)) - 1, True)
      if not tree.cut(n).is_chain and spine not in candidates:
        candidates.append(spine)
      candidates.append(Candidate(n))
    return tuple(candidates)

  def rows(self, k: int, tree: Any = None) -> int:
    """A: the acceptance estimates per depth its candidates need (2 when some verify a spine)."""
    return 1 + any(c.spine for c in self.candidates(k, tree))


def settings_error(kind: str, prior: float, decay: float, recovery: float,
                   calibration_rounds: int = 1) -> str | None:
  """What is wrong with the policy's settings and its calibration's rounds (None when nothing is),
  starting with the field's name ("k_policy ...", "adaptive.prior ...")."""
  if kind not in (*KINDS, AUTO):
    return f"k_policy must be one of {(*KINDS, AUTO)}, got {kind!r}"
  if not 0.0 < prior < 1.0:
    return f"adaptive.prior must be in (0, 1), got {prior}"
  if not 0.0 <= decay < 1.0:
    return f"adaptive.decay must be in [0, 1), got {decay}"
  if not 0.0 <= recovery <= 1.0:
    return f"adaptive.recovery must be in [0, 1], got {recovery}"
  if int(calibration_rounds) != calibration_rounds or calibration_rounds < 1:
    return f"adaptive.calibration_rounds must be an integer >= 1, got {calibration_rounds}"
  return None


@flax.struct.dataclass
class PolicyState:
  alpha_BxAxK: jax.Array  # [B, A, K] float32: per-row conditional acceptance estimates at each draft position
  prior_AxK: jax.Array  # [A, K] float32: each estimate before any observation, and its drift target
  cost_C: jax.Array  # [C] float32: seconds of a round at each candidate (the cost table)
  chosen_C: jax.Array  # [C] int32: rounds that chose each candidate
  reached_AxK: jax.Array  # [A, K] float32: rounds (summed over rows) that reached each position (`Memory`)
  accepted_AxK: jax.Array  # [A, K] float32: those that accepted it


def init(policy: KPolicy, batch: int, candidates: tuple[Candidate, ...], cost_C: jax.Array,
         prior_AxK: jax.Array) -> PolicyState:
  prior_AxK = jnp.asarray(prior_AxK, jnp.float32)
  return PolicyState(alpha_BxAxK=jnp.broadcast_to(prior_AxK, (batch, *prior_AxK.shape)), prior_AxK=prior_AxK,
                     cost_C=jnp.asarray(cost_C, jnp.float32), chosen_C=jnp.zeros((len(candidates),), jnp.int32),
                     reached_AxK=jnp.zeros(prior_AxK.shape, jnp.float32),
                     accepted_AxK=jnp.zeros(prior_AxK.shape, jnp.float32))


def expected_committed(alpha_xK: jax.Array) -> jax.Array:
  """[..., K + 1]: expected tokens a round commits when it proposes n = 0 .. K tokens (the accepted
  prefix plus the target's own token), from conditional acceptances [..., K]."""
  reach_xK = jnp.cumprod(alpha_xK, axis=-1)  # P(d_1 .. d_j all accepted)
  return 1.0 + jnp.pad(jnp.cumsum(reach_xK, axis=-1), [(0, 0)] * (alpha_xK.ndim - 1) + [(1, 0)])


def choose(policy: KPolicy, state: PolicyState, live_B: jax.Array,
           candidates: tuple[Candidate, ...]) -> tuple[jax.Array, jax.Array]:
  """(wanted_B [B] int32: the most tokens (the depth) each row proposes this round, the chosen
  candidate's index [])."""
  lengths_C = np.asarray([c.length for c in candidates], np.int32)
  if not policy.adaptive:
    return jnp.full(live_B.shape, lengths_C[0], jnp.int32), jnp.int32(0)
  committed_BxC = expected_committed(state.alpha_BxAxK)[:, [c.row for c in candidates], lengths_C]
  rate_C = jnp.sum(jnp.where(live_B[:, None], committed_BxC, 0.0), axis=0) / state.cost_C
  index = jnp.argmax(rate_C).astype(jnp.int32)
  return jnp.full(live_B.shape, jnp.asarray(lengths_C)[index], jnp.int32), index


def update(policy: KPolicy, state: PolicyState, index: jax.Array, num_proposed_AxB: jax.Array,
           num_accepted_AxB: jax.Array, live_B: jax.Array) -> PolicyState:
  """The state after a round in which, as estimate a sees it, live row b proposed
  `num_proposed_AxB[a, b]` tokens and accepted the first `num_accepted_AxB[a, b]` (0 proposed: a round
  that told estimate a nothing)."""
  chosen_C = state.chosen_C.at[index].add(jnp.int32(1))
  if not policy.adaptive:
    return state.replace(chosen_C=chosen_C)
  reached_AxBxK, accepted_AxBxK = jax.vmap(metrics.reached_and_accepted, in_axes=(0, 0, None, None))(
      num_accepted_AxB, num_proposed_AxB, live_B, state.alpha_BxAxK.shape[2])
  reached_BxAxK, accepted_BxAxK = reached_AxBxK.transpose(1, 0, 2), accepted_AxBxK.transpose(1, 0, 2)
  alpha_BxAxK = jnp.where(reached_BxAxK, policy.decay * state.alpha_BxAxK + (1.0 - policy.decay) * accepted_BxAxK,
                          state.alpha_BxAxK + policy.recovery * (state.prior_AxK[None] - state.alpha_BxAxK))
  return state.replace(alpha_BxAxK=alpha_BxAxK, chosen_C=chosen_C,
                       reached_AxK=state.reached_AxK + jnp.sum(reached_AxBxK, axis=1),
                       accepted_AxK=state.accepted_AxK + jnp.sum(accepted_AxBxK, axis=1))


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
        base = float(np.clip((PRIOR_ROUNDS * base + self.accepted_AxK[a, j])
                             / (PRIOR_ROUNDS + self.reached_AxK[a, j]), 0.01, 0.99))
        prior_AxK[a, j] = base
    return prior_AxK

  def learn(self, reached_AxK: np.ndarray, accepted_AxK: np.ndarray) -> None:
    """Adds a call's rounds that reached each position and those that accepted it (summed over rows);
    a position observed more than MEMORY_ROUNDS times keeps that many, in proportion."""
    self.reached_AxK = self.reached_AxK + reached_AxK
    self.accepted_AxK = self.accepted_AxK + accepted_AxK
    scale_AxK = np.minimum(1.0, MEMORY_ROUNDS / np.maximum(self.reached_AxK, 1.0))
    self.reached_AxK, self.accepted_AxK = self.reached_AxK * scale_AxK, self.accepted_AxK * scale_AxK


def forcing(num_candidates: int, index: int) -> np.ndarray:
  """A cost table under which the adaptive policy always chooses candidate `index` (for `calibrate`)."""
  return np.where(np.arange(num_candidates) == index, 1.0, 1e30).astype(np.float32)


# The least time the timed rounds of one calibration length must take: a round of a small model on a
# fast device lasts milliseconds, and a few of them drown in a call's own jitter. At most MAX_EXTENSIONS
# longer calls per length reach for it.
MIN_TIMED_S = 0.5
MAX_EXTENSIONS = 2


def calibrate(candidates: tuple[Candidate, ...], run: Callable[[np.ndarray, int], int],
              rounds: int = 3) -> np.ndarray:
  """The cost table [C] (seconds per round at each candidate), measured with the compiled
  program itself: `run(cost_C, round_limit)` decodes one batch (blocking until done) with the policy
  forced to one candidate by `cost_C` and at most `round_limit` rounds, and returns the rounds it ran.
  Per candidate: one untimed round first (the first execution of a program's branch is several times
  slower on a CPU: kernels are prepared lazily, and calibration is what first runs most of them), then
  a 1-round call and a (1 + n)-round call, whose difference over the rounds between them is the cost:
  the prefill, the first token and the first round cancel within the same length, so no separately
  timed baseline can bias every entry. n starts at `rounds` and grows until the difference lasts
  MIN_TIMED_S (or the budget ends the call first, or MAX_EXTENSIONS longer calls were made). A
  candidate never costs less than one it covers (`Candidate.covers`: it does what that one does, and
  more), so such a measured dip is lifted: it is noise."""
  def timed(cost_C: np.ndarray, limit: int) -> tuple[float, int]:
    start = time.perf_counter()
    ran = run(cost_C, limit)
    return time.perf_counter() - start, ran

  num_candidates = len(candidates)
  cost_C = np.zeros(num_candidates, np.float32)
  for index in range(num_candidates):
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
    cost_C[index] = seconds / ran
  for index, candidate in enumerate(candidates):  # those it covers come earlier: already lifted
    cost_C[index] = max([cost_C[index]] + [cost_C[j] for j, other in enumerate(candidates[:index])
                                           if candidate.covers(other)])
  return cost_C
