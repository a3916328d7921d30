"""How many draft tokens a round proposes: the K policy, and the plan it hands each round's drafter
(`speculative.plan`).

`fixed` (`KPolicy`, the null policy): every live row proposes K tokens every round (the classic loop).
`adaptive` (`Adaptive`): each round the
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

A lookup (`Drafter.free_proposal`: its proposal costs no pass) proposes first, and the policy prices
what each row offers: a row offering m tokens gains what m tokens are expected to give, whatever L
allows, so a round verifies long only when some row found that much to propose.

Exactness: the length is chosen before the round's draft from the outcomes of earlier rounds only (a
lookup's: after its proposal, a function of the committed history), so given the history it is a
fixed number, and the acceptance rule is exact for any proposal length. A
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
from typing import Any, ClassVar, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import metrics
from specjax.speculative.plan import ChosenPlan, RoundPlan
from specjax.speculative.trees import shapes

KINDS = ("fixed", "adaptive")  # what a compiled program runs
AUTO = "auto"  # config.k_policy's default: adaptive, but fixed for a dynamic tree (`parse`)


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

  def nodes(self, tree: Any) -> int:
    """The tokens its verify pass scores, the pending one included (`tree`: a drafter's, None = a chain)."""
    return self.length + 1 if self.spine else shapes.of(tree).cut_nodes(self.length)


def labels(record: dict) -> list[str]:
  """The candidates' labels of a results record's "lengths" and "spine" lists (`k_policy.tuning`)."""
  spine = record.get("spine") or [False] * len(record["lengths"])
  return [Candidate(n, s).label for n, s in zip(record["lengths"], spine)]


@flax.struct.dataclass
class PolicyState:
  alpha_BxAxK: jax.Array  # [B, A, K] float32: per-row conditional acceptance estimates at each draft position
  prior_AxK: jax.Array  # [A, K] float32: each estimate before any observation, and its drift target
  cost_C: jax.Array  # [C] float32: seconds of a round at each candidate (the cost table)
  chosen_C: jax.Array  # [C] int32: rounds that chose each candidate
  reached_AxK: jax.Array  # [A, K] float32: rounds (summed over rows) that reached each position (`Memory`)
  accepted_AxK: jax.Array  # [A, K] float32: those that accepted it
  full: jax.Array  # [] bool: every live row proposes the chosen length whole (`Tables.full`)


@flax.struct.dataclass
class Tables:
  """The policy's runtime inputs: what a decoder measured on its device and learned from earlier calls
  (None as given: the defaults `KPolicy.tables` fills in)."""

  cost_C: Any = None  # [C] float32 > 0: seconds of a round at each candidate (`tuning.calibrate`)
  prior_AxK: Any = None  # [A, K] float32 in (0, 1): each acceptance estimate's prior (`tuning.Memory`)
  # Calibration: a lookup's short proposals are extended to the chosen length (tokens the rule verifies
  # like any others), so that a forced candidate's rounds cost what its verify pass costs (`calibrate`).
  full: Any = False  # [] bool


@dataclasses.dataclass(frozen=True)
class KPolicy:
  """The fixed policy, and the settings every policy has (hashable: part of the compiled program).
  Fixed, it is the null policy: one candidate (all K tokens, a static tree whole), the null plan
  (`RoundPlan`), nothing learned; `Adaptive` overrides what it chooses and learns."""

  kind: ClassVar[str] = "fixed"  # one of KINDS
  plain_rounds: ClassVar[bool] = False  # some rounds may propose nothing (a drafter may then skip its draft)
  tuned: ClassVar[bool] = False  # its choice reads a cost table a decoder measures (`tuning`)
  prior: float = 0.8  # every position's acceptance prior until a decoder has measured its own (`Memory`)
  decay: float = 0.9  # weight of the old estimate when a round reaches the position
  recovery: float = 0.02  # drift toward the prior per round in which a position is not reached

  def lengths(self, k: int) -> tuple[int, ...]:
    """The proposal lengths a round may choose (static), each one more compiled verify width: K alone."""
    return (k,)

  def widths(self, k: int) -> tuple[int, ...]:
    """The verify widths the chosen lengths need: each length plus the pending token."""
    return tuple(n + 1 for n in self.lengths(k))

  def candidates(self, k: int, tree: Any = None) -> tuple[Candidate, ...]:
    """What a round may verify (static), ordered so that a candidate comes after those it covers: each
    of `lengths(k)`, and where the drafter's `tree` (None: a chain) verifies spines, each length's spine
    before its whole cut (`shapes.Chain.spines`)."""
    return tuple(Candidate(n) for n in self.lengths(k))

  def rows(self, k: int, tree: Any = None) -> int:
    """A: the acceptance estimates per depth its candidates need (2 when some verify a spine)."""
    return 1 + any(c.spine for c in self.candidates(k, tree))

  def tables(self, k: int, tree: Any, given: Tables) -> Tables:
    """The runtime tables for a drafter of this `tree`, checked: `cost_C` [C] positive seconds per
    candidate (default all equal), `prior_AxK` [A, K] (or [K] for every estimate) in (0, 1) (default
    `prior` everywhere)."""
    candidates, rows = self.candidates(k, tree), self.rows(k, tree)
    cost_C, prior_AxK = given.cost_C, given.prior_AxK
    cost_C = np.ones(len(candidates), np.float32) if cost_C is None else np.asarray(cost_C, np.float32)
    if cost_C.shape != (len(candidates),) or not np.all(cost_C > 0):
      raise ValueError(f"cost_C must hold {len(candidates)} positive costs (one per candidate "
                       f"{[c.label for c in candidates]}), got {cost_C}")
    prior_AxK = np.full(k, self.prior, np.float32) if prior_AxK is None else np.asarray(prior_AxK, np.float32)
    prior_AxK = np.broadcast_to(prior_AxK, (rows, k)) if prior_AxK.shape == (k,) else prior_AxK
    if prior_AxK.shape != (rows, k) or not np.all((prior_AxK > 0) & (prior_AxK < 1)):
      raise ValueError(f"prior_AxK must hold {rows} x K = {k} acceptance probabilities in (0, 1), got {prior_AxK}")
    return Tables(jnp.asarray(cost_C), jnp.asarray(prior_AxK), jnp.asarray(given.full, jnp.bool_))

  def init(self, batch: int, candidates: tuple[Candidate, ...], tables: Tables) -> PolicyState:
    prior_AxK = jnp.asarray(tables.prior_AxK, jnp.float32)
    return PolicyState(alpha_BxAxK=jnp.broadcast_to(prior_AxK, (batch, *prior_AxK.shape)), prior_AxK=prior_AxK,
                       cost_C=jnp.asarray(tables.cost_C, jnp.float32), chosen_C=jnp.zeros(
                           (len(candidates),), jnp.int32), reached_AxK=jnp.zeros(prior_AxK.shape, jnp.float32),
                       accepted_AxK=jnp.zeros(prior_AxK.shape, jnp.float32), full=jnp.asarray(tables.full, jnp.bool_))

  def choose(self, state: PolicyState, live_B: jax.Array, candidates: tuple[Candidate, ...],
             offered_B: jax.Array | None = None) -> tuple[RoundPlan, jax.Array]:
    """(the round's plan, the chosen candidate's index []). `offered_B` [B]: the tokens each row's
    proposal holds, when the drafter proposed before the choice (`Drafter.free_proposal`); None: the
    drafter proposes what the plan asks."""
    return RoundPlan(candidates[0].length), jnp.int32(0)

  def update(self, state: PolicyState, index: jax.Array, num_proposed_AxB: jax.Array, num_accepted_AxB: jax.Array,
             live_B: jax.Array) -> PolicyState:
    """The state after a round in which, as estimate a sees it, live row b proposed
    `num_proposed_AxB[a, b]` tokens and accepted the first `num_accepted_AxB[a, b]` (0 proposed: a round
    that told estimate a nothing)."""
    return state.replace(chosen_C=state.chosen_C.at[index].add(jnp.int32(1)))


def expected_committed(alpha_xK: jax.Array) -> jax.Array:
  """[..., K + 1]: expected tokens a round commits when it proposes n = 0 .. K tokens (the accepted
  prefix plus the target's own token), from conditional acceptances [..., K]."""
  reach_xK = jnp.cumprod(alpha_xK, axis=-1)  # P(d_1 .. d_j all accepted)
  return 1.0 + jnp.pad(jnp.cumsum(reach_xK, axis=-1), [(0, 0)] * (alpha_xK.ndim - 1) + [(1, 0)])


@dataclasses.dataclass(frozen=True)
class Adaptive(KPolicy):
  """Chooses each round's length (and a static tree's spine or whole cut) from per-row acceptance
  estimates and the cost table (the module docstring)."""

  kind: ClassVar[str] = "adaptive"
  plain_rounds: ClassVar[bool] = True
  tuned: ClassVar[bool] = True

  def lengths(self, k: int) -> tuple[int, ...]:
    """0 to 3, two thirds of K, and K."""
    return tuple(sorted({min(n, k) for n in (0, 1, 2, 3)} | {round(2 * k / 3), k}))

  def candidates(self, k: int, tree: Any = None) -> tuple[Candidate, ...]:
    shape = shapes.of(tree)
    if shape.drawn_each_round:
      raise ValueError("the adaptive K policy chooses chain lengths and static trees' depths: a drafter with a "
                       "dynamic tree uses the fixed policy")
    if not shape.spines:
      return super().candidates(k, tree)
    candidates = []
    for n in self.lengths(k):
      spine = Candidate(shape.spine_depth(n), True)
      if shape.branches_within(n) and spine not in candidates:
        candidates.append(spine)
      candidates.append(Candidate(n))
    return tuple(candidates)

  def choose(self, state: PolicyState, live_B: jax.Array, candidates: tuple[Candidate, ...],
             offered_B: jax.Array | None = None) -> tuple[ChosenPlan, jax.Array]:
    """With `offered_B` (a lookup's proposal, made first), a row offering m < L tokens commits what m
    tokens are expected to give: a length beyond every live offer gains nothing over the shorter
    candidate the round would verify anyway, and costs no less (`calibrate` keeps the table
    monotone), so it is never chosen. Calibration (`full`) takes every offer as whole: a forced
    candidate is verified at its own length."""
    lengths_C = np.asarray([c.length for c in candidates], np.int32)
    rows_C = [c.row for c in candidates]
    committed_BxAxK1 = expected_committed(state.alpha_BxAxK)
    if offered_B is None:
      committed_BxC = committed_BxAxK1[:, rows_C, lengths_C]
    else:
      offered_B = jnp.where(state.full, lengths_C.max(), offered_B)
      reach_BxC = jnp.minimum(jnp.asarray(lengths_C)[None, :], offered_B[:, None])
      committed_BxC = jnp.take_along_axis(committed_BxAxK1[:, rows_C, :], reach_BxC[:, :, None], axis=2)[..., 0]
    rate_C = jnp.sum(jnp.where(live_B[:, None], committed_BxC, 0.0), axis=0) / state.cost_C
    index = jnp.argmax(rate_C).astype(jnp.int32)
    spines = any(c.spine for c in candidates)
    plan = ChosenPlan(int(lengths_C.max()), jnp.full(live_B.shape,
                                                     jnp.asarray(lengths_C)[index], jnp.int32),
                      jnp.asarray([c.spine for c in candidates])[index] if spines else None, state.full)
    return plan, index

  def update(self, state: PolicyState, index: jax.Array, num_proposed_AxB: jax.Array, num_accepted_AxB: jax.Array,
             live_B: jax.Array) -> PolicyState:
    reached_AxBxK, accepted_AxBxK = jax.vmap(metrics.reached_and_accepted,
                                             in_axes=(0, 0, None, None))(num_accepted_AxB, num_proposed_AxB, live_B,
                                                                         state.alpha_BxAxK.shape[2])
    reached_BxAxK, accepted_BxAxK = reached_AxBxK.transpose(1, 0, 2), accepted_AxBxK.transpose(1, 0, 2)
    alpha_BxAxK = jnp.where(reached_BxAxK, self.decay * state.alpha_BxAxK + (1.0 - self.decay) * accepted_BxAxK,
                            state.alpha_BxAxK + self.recovery * (state.prior_AxK[None] - state.alpha_BxAxK))
    return super().update(state, index, num_proposed_AxB, num_accepted_AxB,
                          live_B).replace(alpha_BxAxK=alpha_BxAxK,
                                          reached_AxK=state.reached_AxK + jnp.sum(reached_AxBxK, axis=1),
                                          accepted_AxK=state.accepted_AxK + jnp.sum(accepted_AxBxK, axis=1))


def parse(kind: str, prior: float, decay: float, recovery: float, drawn_each_round: bool) -> KPolicy:
  """The policy config.k_policy and config.adaptive name, for a drafter whose tree is
  `drawn_each_round` (a dynamic tree: "auto" is fixed for it, "adaptive" refused); a ValueError naming
  the field ("k_policy ...", "adaptive.prior ...") for settings that cannot work."""
  if kind not in (*KINDS, AUTO):
    raise ValueError(f"k_policy must be one of {(*KINDS, AUTO)}, got {kind!r}")
  if not 0.0 < prior < 1.0:
    raise ValueError(f"adaptive.prior must be in (0, 1), got {prior}")
  if not 0.0 <= decay < 1.0:
    raise ValueError(f"adaptive.decay must be in [0, 1), got {decay}")
  if not 0.0 <= recovery <= 1.0:
    raise ValueError(f"adaptive.recovery must be in [0, 1], got {recovery}")
  if kind == "adaptive" and drawn_each_round:
    raise ValueError("k_policy 'adaptive' chooses chain lengths and static trees' depths: with a dynamic "
                     "config.tree, use k_policy 'fixed' or 'auto'")
  adaptive = kind == "adaptive" or (kind == AUTO and not drawn_each_round)
  return (Adaptive if adaptive else KPolicy)(prior, decay, recovery)
