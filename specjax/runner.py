"""One padded batch through the compiled program of a decode spec's mode (speculative or autoregressive),
the caches carried from call to call: what `pipeline` runs, and what the adaptive K policy's tuning
times (`k_policy.tuning`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import jax
import numpy as np

from specjax import autoregressive, costs, mesh as meshes, partitioning
from specjax.constraints.mask import Unconstrained
from specjax.decode_spec import DecodeSpec
from specjax.generation import Request
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.load import LoadedModel
from specjax.speculative.drafters.base import Drafter
from specjax.speculative import k_policy
from specjax.speculative.k_policy import Candidate, Memory, Tables
from specjax.speculative.loop import SpeculativeLoop, speculative_generate


@dataclasses.dataclass
class Runner:
  """Runs one padded batch through the compiled program of the configured mode.

  Every batch has one shape, so the caches a call returns (its donated ones, updated) are passed to
  the next call: the target cache and the drafter's storage are allocated once, by the first call."""

  spec: DecodeSpec
  target: LoadedModel
  drafter: Drafter | None  # None in autoregressive mode
  cache_len: int
  target_cache: KVCache | None = None  # [L, B, S, G, Dh] returned by the last call; None before
  draft_storage: Any = None  # the drafter's storage returned by the last call (None before)
  memory: Memory | None = None  # the K policy's cost table and acceptance prior; None = nothing tuned
  constraint: Any = Unconstrained()  # the next batch's rows' constraints (`constraints.compiler.RunConstraints.rows`)

  def __call__(self, prompts_BxP: np.ndarray, lengths_B: np.ndarray, budget_B: np.ndarray, key,
               round_limit: int | None = None, cost_C: np.ndarray | None = None, lower: str = "",
               calibrating: bool = False):
    """The batch's output; with `lower` (a platform), the program lowered for it instead (nothing runs);
    `calibrating`: the policy's `Tables.full` (a lookup's proposals verified at the chosen length)."""
    part = self.target.part
    cost_C = self.memory.cost_C if cost_C is None and self.memory else cost_C
    request = Request(prompts_BxP, lengths_B, budget_B, self.target.tokenizer.eos_ids,
                      self.spec.sampling.replace(constraint=self.constraint), key, round_limit)
    if part is None:
      out = self._generate(request, cost_C, lower, calibrating)
    else:
      with jax.set_mesh(part.mesh):
        rows = jax.device_put((prompts_BxP, lengths_B, budget_B), partitioning.rows_sharding(part))
        out = self._generate(request.replace(prompts_BxP=rows[0], prompt_lengths_B=rows[1], max_new_tokens=rows[2]),
                             cost_C, lower, calibrating)
    if self.memory and not lower:  # what the policy learns from every call, calibration's included
      self.memory.learn(*meshes.to_host((out.policy_reached, out.policy_accepted)))
    return out

  @property
  def candidates(self) -> tuple[Candidate, ...]:
    """What the policy's rounds may verify (`KPolicy.candidates`)."""
    return self.spec.policy.candidates(self.spec.k, self.drafter.tree)

  def calibrate(self, prompts_BxP: np.ndarray, lengths_B: np.ndarray, budget_B: np.ndarray, key,
                rounds: int) -> k_policy.Prices:
    """The K policy's prices on this device and batch shape (`k_policy.Prices`): each candidate's passes
    timed alone at the batch's mid-generation cache offset (`costs.candidate_passes`), plus what a
    plain round of the compiled program costs beyond its 1-token pass (`k_policy.forced_round_seconds`,
    `rounds` timed), and the seconds of a call that runs no round (its prefill)."""
    candidates = self.candidates

    def run(cost_C: np.ndarray, round_limit: int) -> int:
      out = self(prompts_BxP, lengths_B, budget_B, key, round_limit, cost_C, calibrating=True)
      return int(jax.block_until_ready(out.target_calls)) - 1

    forced = k_policy.forcing(len(candidates), 0)
    run(forced, 0)
    prefill_s = []
    for _ in range(3):
      start = time.perf_counter()
      run(forced, 0)
      prefill_s.append(time.perf_counter() - start)
    plain_s = k_policy.forced_round_seconds(len(candidates), 0, run, rounds)
    # Rounds at the longest candidate, timed as a check of the priced table, and observed: a plain round
    # observes nothing, so these teach the acceptance prior (`Memory.learn`) whatever the policy chooses.
    longest_s = k_policy.forced_round_seconds(len(candidates), len(candidates) - 1, run, rounds)
    offset = prompts_BxP.shape[1] + int(np.max(budget_B)) // 2
    with contextlib.ExitStack() as stack:
      if self.target.part is not None:
        stack.enter_context(jax.set_mesh(self.target.part.mesh))
      passes_C = costs.candidate_passes(self.target.config, self.target.params, self.drafter, candidates,
                                        len(lengths_B), self.cache_len,
                                        min(offset, self.cache_len - self.spec.verify_width))
    return k_policy.Prices(passes_C, max(plain_s - float(passes_C[0]), 0.0), float(np.median(prefill_s)), longest_s)

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
                leaf, partitioning.rows_sharding(part) if leaf.ndim else part.sharding()),
            self.draft_storage)

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
