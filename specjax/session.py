"""A decode session: one compiled decode program of a pair of loaded models, and the state it carries
from call to call.

A `Session` owns, for one program identity (`program_key`, built here and nowhere else):
  - the caches: the target's and the drafter's storage, allocated by the first call and passed (donated,
    updated) to the next, since every batch has one shape;
  - the adaptive K policy's memory (`k_policy.Memory`: its cost table and learned acceptance);
  - the prompt widths it has compiled and run once (a warm width skips the warm-up call).
The built drafter, with what it learned (`Drafter.remember`: a suffix drafter's pool), is shared by the
sessions of one drafter setting: a longer prompt opens another session and still drafts from the pool.
`Sessions`, one per loaded pair (what `specjax.Decoder` holds), opens them; `pipeline.run` decodes
turns x batches through one session; the K policy's tuning times its calls (`k_policy.tuning`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from specjax import autoregressive, costs, generation, mesh as meshes, partitioning, prompts
from specjax.constraints import compiler
from specjax.constraints.mask import Unconstrained
from specjax.decode_spec import DecodeSpec
from specjax.generation import Request
from specjax.models.kv_cache import init_cache
from specjax.models.load import LoadedModel
from specjax.sampling import Knobs, SamplingParams
from specjax.speculative.drafters.base import Drafter
from specjax.speculative import k_policy
from specjax.speculative.k_policy import Candidate, Tables, tuning
from specjax.speculative.loop import SpeculativeLoop, speculative_generate

Models = tuple[LoadedModel, LoadedModel | None]  # (target, draft model or None)


@dataclasses.dataclass
class BuiltDrafter:
  """A drafter built for the loaded models, the facts recorded with its results, and what it learned
  from the calls so far (`Drafter.remember`; its sessions store the drafter each call ends with)."""

  drafter: Drafter
  info: dict


def build_drafter(spec: DecodeSpec, target: LoadedModel, draft: LoadedModel | None,
                  log: Callable[[str], None] = print) -> BuiltDrafter:
  """The drafter of `spec` for the loaded models (`Drafter.build`), and facts to record with the results."""
  drafter, info = spec.drafter.build(spec.drafter_settings, target, draft, log)
  drafter.check(target.config)
  if spec.tree is not None:
    info["tree_nodes"] = spec.tree.nodes_with_root - 1
  return BuiltDrafter(drafter, info)


def program_key(spec: DecodeSpec, cache_len: int, built: BuiltDrafter | None,
                constraints: compiler.RunConstraints | None) -> tuple:
  """A session's identity: everything compiled into its program. Every config field but the runtime
  ones, with sampling's static flags (`DecodeSpec.program`: the weight formats and execution settings
  are config fields), the cache length, the built drafter (its class, and the object: a drafter built
  for another setting, or given as an instance, compiles its own program), and the shape of the
  constraint table (a runtime value whose shape is compiled in). The prompt width shapes only the
  prefill: a session compiles one program per width (`Session.warm_up`)."""
  drafter = None if built is None else (type(built.drafter), id(built))
  return *spec.program(cache_len), drafter, None if constraints is None else constraints.next_ZxV.shape


@dataclasses.dataclass(frozen=True)
class Row:
  """One row of a batch: a request's input ids at one turn, the constraint it decodes under, its budget
  and its sampling knobs."""

  ids: Sequence[int]
  constraint: str  # a constraint spec (`compiler.spec_of`); "" = none
  budget: int  # new tokens, at most config.max_new_tokens (`prompts.Request.budget`)
  knobs: Knobs  # temperature, top-k, top-p (`prompts.Request.knobs`), within the session's program's mode


@dataclasses.dataclass(frozen=True)
class Batch:
  """One padded batch (every batch of a session has one shape): B = config.batch_size rows, the first
  `real` of them requests, the rest copies of the first one with a budget of 1 (dropped from results)."""

  prompts_BxP: np.ndarray
  lengths_B: np.ndarray
  budget_B: np.ndarray  # new tokens per row
  constraint: Any = Unconstrained()  # the rows' device constraint (`compiler.RunConstraints.rows`)
  real: int = 0
  sampling: SamplingParams | None = None  # the program's, each row's knobs [B] (`for_rows`); None: the config's

  def with_budget(self, budget: int) -> Batch:
    return dataclasses.replace(self, budget_B=np.full_like(self.budget_B, budget))


@dataclasses.dataclass(frozen=True)
class Decoded:
  """What one batch produced: its real rows' token ids, the loop's output, the call's wall time, and
  the cost table held against it (`k_policy.Memory.check`; None when none was checked)."""

  token_ids: list[list[int]]
  out: Any
  wall_s: float
  cost_check: dict[str, Any] | None


class Session:
  """One decode program of the loaded models and the state it carries between calls (module docstring)."""
  def __init__(self, spec: DecodeSpec, target: LoadedModel, built: BuiltDrafter | None, cache_len: int):
    self.spec, self.target, self.built, self.cache_len = spec, target, built, cache_len
    self.constraints: compiler.RunConstraints | None = None
    self.target_cache = None  # [L, B, S, G, Dh], returned by the last call; None before the first
    self.draft_storage = None  # the drafter's storage returned by the last call
    self.memory: k_policy.Memory | None = None  # the K policy's cost table and acceptance; None = untuned
    self.widths: set[int] = set()  # prompt widths compiled and run once

  def bind(self, spec: DecodeSpec, constraints: compiler.RunConstraints | None) -> Session:
    """This session for a run of `spec` (of the same program: its runtime fields may differ: sampling
    values, seed, budgets) whose requests' constraints are `constraints` (a table of the same shape)."""
    self.spec, self.constraints = spec, constraints
    return self

  @property
  def drafter(self) -> Drafter | None:
    return None if self.built is None else self.built.drafter

  @property
  def candidates(self) -> tuple[Candidate, ...]:
    """What the policy's rounds may verify (`KPolicy.candidates`)."""
    return self.spec.policy.candidates(self.spec.k, self.drafter.tree)

  def batch(self, rows: Sequence[Row], width: int) -> Batch:
    """`rows` padded to width `width` (the program's) and to the batch size (filler: the first row)."""
    size = self.spec.config.batch_size
    filled = list(rows) + [rows[0]] * (size - len(rows))
    prompts_BxP, lengths_B = generation.pad_prompts([list(r.ids) for r in filled], width=width)
    budget_B = np.array([r.budget for r in rows] + [1] * (size - len(rows)), np.int32)
    constraint = Unconstrained() if self.constraints is None else self.constraints.rows([r.constraint for r in rows] +
                                                                                        [""] * (size - len(rows)))
    return Batch(prompts_BxP, lengths_B, budget_B, constraint, len(rows),
                 self.spec.sampling.for_rows([r.knobs for r in filled]))

  def __call__(self, batch: Batch, key, round_limit: int | None = None, cost_C: np.ndarray | None = None,
               lower: str = "", calibrating: bool = False, learn: bool = True):
    """The batch's output; with `lower` (a platform), the program lowered for it instead (nothing runs);
    `calibrating`: the policy's `Tables.full` (a lookup's proposals verified at the chosen length);
    `learn`: the policy's memory learns the call's acceptance (not from a profiler's extra calls)."""
    part = self.target.part
    cost_C = self.memory.cost_C if cost_C is None and self.memory else cost_C
    sampling = self.spec.sampling if batch.sampling is None else batch.sampling
    request = Request(batch.prompts_BxP, batch.lengths_B, batch.budget_B, self.target.tokenizer.eos_ids,
                      sampling.replace(constraint=batch.constraint), key, round_limit)
    if part is None:
      out = self._generate(request, cost_C, lower, calibrating)
    else:
      with jax.set_mesh(part.mesh):
        rows = jax.device_put((batch.prompts_BxP, batch.lengths_B, batch.budget_B), partitioning.rows_sharding(part))
        out = self._generate(request.replace(prompts_BxP=rows[0], prompt_lengths_B=rows[1], max_new_tokens=rows[2]),
                             cost_C, lower, calibrating)
    if self.memory and learn and not lower:  # what the policy learns from its calls, calibration's included
      self.memory.learn(*meshes.to_host((out.policy_reached, out.policy_accepted)))
    return out

  def warm_up(self, batch: Batch, key, log: Callable[[str], None]) -> float:
    """Compiles the program for the batch's width and runs its loop body once (a 2-token budget: a
    branch's first execution on a CPU is several times slower, kernels are prepared lazily), unless
    this width ran before; returns the seconds it took (0 when warm)."""
    width = batch.prompts_BxP.shape[1]
    if width in self.widths:
      return 0.0
    log(f"compiling the {self.spec.config.mode} program (batch {len(batch.lengths_B)}, cache {self.cache_len}) ...")
    start = time.perf_counter()
    jax.block_until_ready(self(batch.with_budget(min(2, self.spec.config.max_new_tokens)), key).tokens)
    self.widths.add(width)
    return time.perf_counter() - start

  def tune(self, batch: Batch, key, log: Callable[[str], None]) -> dict[str, Any]:
    """The K policy's record for the results. A tuned policy keeps its memory in the session, tuned
    with `batch` unless it is already (`k_policy.tuning.tune`: a stored table, else measured)."""
    policy, candidates = self.spec.policy, self.candidates
    record = tuning.record(policy, candidates)
    if not policy.tuned:
      return record
    if self.memory is None:
      self.memory = k_policy.Memory(policy.prior, self.spec.k, policy.rows(self.spec.k, self.drafter.tree))
    measure = functools.partial(self.calibrate, batch.with_budget(self.spec.config.max_new_tokens), key)
    return {
        **record,
        **tuning.tune(self.memory, self.spec.tuning, self.spec.description(self.cache_len), candidates, measure, log)
    }

  def generate(self, batch: Batch, key, profiler=None) -> Decoded:
    """Decodes `batch` (`profiler`: a `round_profile.Profiler` that times it too); the policy's cost
    table is held against the call, and the drafter learns what the real rows decoded."""
    start = time.perf_counter()
    out = self(batch, key)
    tokens_BxW, counts_B = meshes.to_host((out.tokens, out.counts))
    wall = time.perf_counter() - start
    if profiler is not None:
      profiler.batch(self, batch, key, out, wall)
    check = None
    if self.memory is not None:
      rounds_C = meshes.to_host(out.rounds_per_length)
      check = self.memory.check(rounds_C, wall, any(n and c.length for n, c in zip(rounds_C, self.candidates)))
    if self.built is not None:  # the real rows' sequences, for the next batch, turn and run
      real_B = np.arange(len(batch.lengths_B)) < batch.real
      self.built.drafter = self.drafter.remember(batch.prompts_BxP, np.where(real_B, batch.lengths_B, 0), out.tokens,
                                                 np.where(real_B, counts_B, 0))
    token_ids = [[int(t) for t in tokens_BxW[row, :counts_B[row]]] for row in range(batch.real)]
    return Decoded(token_ids, out, wall, check)

  def calibrate(self, batch: Batch, key, rounds: int) -> k_policy.Prices:
    """The K policy's prices on this device and batch shape (`k_policy.Prices`): each candidate's passes
    timed alone at the batch's mid-generation cache offset (`costs.candidate_passes`), plus what a
    round of the compiled program costs beyond its passes (`k_policy.Prices.measured`: plain rounds and the
    longest candidate's, `rounds` each, `k_policy.forced_round_seconds`), and the seconds of a call that
    runs no round (its prefill)."""
    candidates = self.candidates

    def run(cost_C: np.ndarray, round_limit: int) -> int:
      out = self(batch, key, round_limit, cost_C, calibrating=True)
      return int(jax.block_until_ready(out.target_calls)) - 1

    forced = k_policy.forcing(len(candidates), 0)
    run(forced, 0)
    prefill_s = []
    for _ in range(3):
      start = time.perf_counter()
      run(forced, 0)
      prefill_s.append(time.perf_counter() - start)
    plain = k_policy.forced_round_seconds(len(candidates), 0, run, rounds)
    # Rounds at the longest candidate, timed as a check of the priced table, and observed: a plain round
    # observes nothing, so these teach the acceptance prior (`Memory.learn`) whatever the policy chooses.
    longest = k_policy.forced_round_seconds(len(candidates), len(candidates) - 1, run, rounds)
    offset = batch.prompts_BxP.shape[1] + int(np.max(batch.budget_B)) // 2
    with contextlib.ExitStack() as stack:
      if self.target.part is not None:
        stack.enter_context(jax.set_mesh(self.target.part.mesh))
      passes_C = costs.candidate_passes(self.target.config, self.target.params, self.drafter, candidates,
                                        len(batch.lengths_B), self.cache_len,
                                        min(offset, self.cache_len - self.spec.verify_width))
    return k_policy.Prices.measured(passes_C, plain, longest, float(np.median(prefill_s)))

  def _allocate(self, batch: int) -> None:
    """The target cache and the drafter's storage, born on the mesh when there is one (under it)."""
    part = self.target.part
    if self.target_cache is not None:
      return
    self.target_cache = init_cache(self.target.config, batch, self.cache_len,
                                   partitioning.cache_sharding(self.target.config, part))
    if self.drafter is not None:
      self.draft_storage = self.drafter.storage(batch, self.cache_len)
      if part is not None:  # caches are born sharded; rows of any other storage go to `data`
        self.draft_storage = jax.tree.map(
            lambda leaf: leaf if leaf.sharding.num_devices > 1 else jax.device_put(
                leaf,
                partitioning.rows_sharding(part) if leaf.ndim else part.sharding()), self.draft_storage)

  def _generate(self, request: Request, cost_C: np.ndarray | None, lower: str, calibrating: bool = False):
    spec, target = self.spec, self.target
    self._allocate(request.prompts_BxP.shape[0])
    out_width = spec.config.max_new_tokens
    if not spec.speculative:
      out = autoregressive.generate(target.config, target.params, request, self.target_cache, out_width=out_width,
                                    lower=lower)
      if not lower:
        self.target_cache = out.cache
      return out
    loop = SpeculativeLoop(target.config, spec.k, out_width=out_width, policy=spec.policy)
    tables = Tables(cost_C, self.memory.prior_AxK if self.memory else None, calibrating)
    out = speculative_generate(loop, target.params, self.drafter, request, self.target_cache, self.draft_storage,
                               tables, lower)
    if not lower:
      self.target_cache, self.draft_storage = out.target_cache, self.drafter.storage_of(out.draft_state)
    return out


class Sessions:
  """The sessions of one pair of loaded models, one per program identity, and the built drafters they
  share, one per drafter setting (`DecodeSpec.drafter_key`): what `specjax.Decoder` keeps between calls."""
  def __init__(self, models: Models, drafter: BuiltDrafter | None = None, log: Callable[[str], None] = print):
    """`drafter`: one built drafter, used for every speculative spec (a Decoder given a Drafter instance)."""
    self.target, self.draft = models
    self._log = log
    self._given = drafter
    self._drafters: dict[tuple, BuiltDrafter] = {}
    self._sessions: dict[tuple, Session] = {}

  @property
  def models(self) -> Models:
    return self.target, self.draft

  def drafter(self, spec: DecodeSpec) -> BuiltDrafter | None:
    """The built drafter of `spec` (the given instance, else built once per setting); None when autoregressive."""
    if not spec.speculative:
      return None
    if self._given is not None:
      return self._given
    if spec.drafter_key not in self._drafters:
      self._drafters[spec.drafter_key] = build_drafter(spec, self.target, self.draft, self._log)
    return self._drafters[spec.drafter_key]

  def open(self, spec: DecodeSpec, requests: Sequence[prompts.Request]) -> tuple[Session, int]:
    """The session that decodes `requests` under `spec`, and the prompt width of its batches: one
    width for every turn of every request, with room for the budget and a verify pass past it."""
    spec = spec.covering([r.knobs(spec.knobs) for r in requests])  # one program for every row's knobs
    cfg, tokenizer = spec.config, self.target.tokenizer
    width = prompts.width_bound(tokenizer, requests, cfg.chat, cfg.max_new_tokens)
    cache_len = -(-(width + cfg.max_new_tokens + spec.verify_width) // 64) * 64
    constraints = _constraints(spec, requests, self.target)
    built = self.drafter(spec)
    key = program_key(spec, cache_len, built, constraints)
    if key not in self._sessions:
      self._sessions[key] = Session(spec, self.target, built, cache_len)
    return self._sessions[key].bind(spec, constraints), width

  def forget(self) -> None:
    """Every drafter forgets what the calls taught it (`Drafter.forget`)."""
    for built in [*self._drafters.values(), *filter(None, [self._given])]:
      built.drafter = built.drafter.forget()


def constraint_of(spec: DecodeSpec, request: prompts.Request) -> str:
  """The constraint a request decodes under: its own, else `config.constraint` ("" = none)."""
  return request.constraint or spec.config.constraint


def _constraints(spec: DecodeSpec, requests: Sequence[prompts.Request],
                 target: LoadedModel) -> compiler.RunConstraints | None:
  """The requests' constraints, one table for all their batches (None when none has one); an error
  names the field of the first request that gave the failing one."""
  specs = [constraint_of(spec, r) for r in requests]
  if not any(specs):
    return None
  strings = compiler.token_strings(target.tokenizer, target.config.vocab_size)
  fields = [r.field("constraint") if r.constraint else "config.constraint" for r in requests]
  return compiler.for_run(specs, strings, target.tokenizer.eos_ids, fields)
