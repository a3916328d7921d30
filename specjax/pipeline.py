"""From a decode config to generated texts and statistics: the library behind `python -m specjax.decode`.

It loads the models, checks that draft and target speak the same token language, encodes the prompts
(optionally through the chat template), runs them in fixed-size batches through one compiled program
(speculative or autoregressive), and gathers per-prompt outputs and aggregate statistics. The first
call of each program runs with a 2-token budget to compile it and run its loop body once (a branch's
first execution on a CPU is several times slower: kernels are prepared lazily), so throughput excludes
both and compile time (that call) is reported on its own.

With `mesh` set the weights load straight into their shards on a `jax.sharding.Mesh`, the caches are
allocated sharded, prompts and per-row state are split over `data`, and the programs run under
`jax.set_mesh` (GSPMD partitions them; see `specjax.partitioning`). In a multi-process run every
process runs the same calls; only process 0 logs and writes results.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np

from specjax import generation, lowering, mesh as meshes, metrics, partitioning, prompts, records, round_profile
from specjax.constraints import compiler
from specjax.decode_spec import DecodeSpec, from_config
from specjax.errors import ConfigError
from specjax.models import matmul, quantized
from specjax.models.load import LoadedModel, load_model, with_execution
from specjax.runner import Runner
from specjax.speculative.drafters.base import Drafter
from specjax.speculative import k_policy
from specjax.speculative.k_policy import tuning

def check_output(path: str) -> None:
  """Proves that results can be written to `path` (its directory exists and takes a file) before any
  model loads; a missing or read-only location otherwise fails after all the generation."""
  directory = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise ValueError(f"config.output {path} is a directory; give a file path")
  if not os.path.isdir(directory):
    raise ValueError(f"config.output {path}: directory {directory} does not exist")
  try:
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".specjax-write-test-"):
      pass
  except OSError as e:
    raise ValueError(f"config.output {path}: cannot write in {directory} ({e.strerror or e})") from None


def write_results(results: dict, path: str, log: Callable[[str], None]) -> str:
  """Writes `results` as JSON to `path`; if that fails, to a fallback file in the temporary directory
  (the generation is never lost). Returns the path written ("" if even the fallback failed)."""
  for target in (path, os.path.join(tempfile.gettempdir(), f"specjax-results-{time.strftime('%Y%m%d-%H%M%S')}"
                                    f"-{os.getpid()}.json")):
    try:
      with open(target, "w") as f:
        json.dump(results, f, indent=1)
      log(f"wrote {target}")
      return target
    except OSError as e:
      log(f"could not write {target}: {e.strerror or e}")
  return ""


def _tune(spec: DecodeSpec, runner: Runner, policy_memory: dict[tuple, k_policy.Memory],
          batch: tuple[np.ndarray, np.ndarray], key, log: Callable[[str], None], program: tuple) -> dict[str, Any]:
  """The K policy's record for the results. A tuned policy keeps one `k_policy.Memory` per compiled
  program in `policy_memory` (every batch has one shape), tuned with the first `batch` (prompts [B, P],
  lengths [B]) unless it is already (`k_policy.tuning.tune`); every call teaches it acceptance. `program`
  identifies the compiled program (`DecodeSpec.program` and what else shapes it)."""
  policy, candidates = spec.policy, runner.candidates
  record = tuning.record(policy, candidates)
  if not policy.tuned:
    return record
  if program not in policy_memory:
    policy_memory[program] = k_policy.Memory(policy.prior, spec.k, policy.rows(spec.k, runner.drafter.tree))
  runner.memory = policy_memory[program]
  measure = functools.partial(runner.calibrate, *batch, np.full(len(batch[1]), spec.config.max_new_tokens, np.int32),
                              key)
  return {**record, **tuning.tune(runner.memory, spec.tuning, spec.description(runner.cache_len), candidates,
                                  measure, log)}


def _constraint(spec: DecodeSpec, request: prompts.Request) -> str:
  """The constraint a request decodes under: its own, else `config.constraint` ("" = none)."""
  return request.constraint or spec.config.constraint


def _constraints(spec: DecodeSpec, requests: Sequence[prompts.Request],
                 target: LoadedModel) -> compiler.RunConstraints | None:
  """The run's constraints, one table for all batches (None when no request has one); an error names
  the field of the first request that gave the failing one."""
  specs = [_constraint(spec, r) for r in requests]
  if not any(specs):
    return None
  strings = compiler.token_strings(target.tokenizer, target.config.vocab_size)
  fields = [r.field("constraint") if r.constraint else "config.constraint" for r in requests]
  return compiler.for_run(specs, strings, target.tokenizer.eos_ids, fields)


def _batches(prompt_ids: Sequence[list[int]], batch_size: int, width: int):
  """(indices, padded prompts [B, P], lengths [B]) with one shape for every batch, so the program
  compiles once: P = `width` (`prompts.width_bound`: the longest prompt of any turn), B = batch_size (a
  short last batch is filled with copies of its first prompt, which get a budget of 1 and are dropped
  from the results)."""
  for start in range(0, len(prompt_ids), batch_size):
    indices = list(range(start, min(start + batch_size, len(prompt_ids))))
    rows = [prompt_ids[i] for i in indices]
    rows += [rows[0]] * (batch_size - len(rows))
    yield indices, *generation.pad_prompts(rows, width=width)


def load_models(spec: DecodeSpec | ml_collections.ConfigDict, log: Callable[[str], None] = print,
                target: LoadedModel | None = None) -> tuple[LoadedModel, LoadedModel | None]:
  """The target and (for a drafter that loads a draft model) the draft of `spec` (whose tokenizer the
  drafter's `build` checks: another one drafts through the token-level intersection). `target`: the
  spec's target already loaded (its mesh and execution settings are the draft's): only the draft loads,
  for a benchmark comparing drafts of one target."""
  spec = spec if isinstance(spec, DecodeSpec) else from_config(spec)
  cfg = spec.config
  start = time.perf_counter()
  if target is None:
    mesh = meshes.make_mesh(cfg.mesh)
    target_part = None
    if mesh is not None:
      target_part = partitioning.Partitioning(mesh, partitioning.DECODE_RULES, cfg.mesh_indivisible, "target")
      log(f"mesh {dict(mesh.shape)} over {mesh.size} {jax.devices()[0].device_kind} devices")
    log(f"loading target {cfg.target} ({cfg.dtype}{_weights_note(cfg.weights)}) ...")
    target = with_execution(_load(cfg.target, cfg.dtype, target_part, cfg.weights, "config.weights"),
                            spec.execution, target_part)
  draft = None
  if spec.loads_draft_model:
    draft_part = None if target.part is None else dataclasses.replace(target.part, name="draft")
    draft_part = draft_part.replicated() if draft_part and cfg.draft_sharding == "replicated" else draft_part
    field = spec.drafter_settings.field("weights")
    log(f"loading draft {cfg.draft} ({cfg.dtype}{_weights_note(spec.draft_weights)}) ...")
    draft = with_execution(_load(cfg.draft, cfg.dtype, draft_part, spec.draft_weights, field),
                           spec.draft_execution, draft_part)
  log(f"loaded in {time.perf_counter() - start:.1f} s; weight matmuls: "
      f"{matmul.describe(target.config.matmul, target.config.dtype, quantized.describe(target.params))}")
  return target, draft


def _weights_note(weights: str) -> str:
  return "" if weights.strip() == "float" else f", weights {weights}"


def _load(name: str, dtype: str, part, weights: str, field: str) -> LoadedModel:
  """`load_model` with the weight format `weights`; a format the model cannot take names `field`."""
  try:
    return load_model(name, dtype, part, weights)
  except quantized.FormatError as error:
    raise ConfigError(f"{field}: {error}") from None


def devices_record(target: LoadedModel, draft: LoadedModel | None) -> dict[str, Any]:
  """The devices a run used, for its results: mesh, device kind and count, processes, what the weight
  matmuls ran on, and the bytes of each model's parameters per device (the most any device holds)."""
  record = meshes.describe(target.part.mesh if target.part else None)
  record["target_weights"] = quantized.describe(target.params)
  record["matmul"] = matmul.describe(target.config.matmul, target.config.dtype, record["target_weights"])
  record["numerics"] = target.config.numerics  # `ModelConfig.numerics`: batch_invariant or fast
  for role, model in (("target", target), ("draft", draft)):
    if model is not None:
      record[f"{role}_param_bytes_per_device"] = max(partitioning.bytes_per_device(model.params).values())
  return record


def check_inputs(spec: DecodeSpec, requests: Sequence[prompts.Request] | None = None) -> list[prompts.Request]:
  """The requests (`requests`, else the config's prompts), and the output location, proven writable:
  everything that can fail cheaply fails before the models load (up to minutes for real ones)."""
  cfg = spec.config
  requests = list(requests) if requests is not None else prompts.requests(cfg.prompts, cfg.prompts_file)
  if not requests:
    raise ConfigError("no prompt to decode")
  turns = max(len(r.turns) for r in requests)
  if turns > 1 and not cfg.chat:
    source = f"config.prompts_file {cfg.prompts_file}: " if cfg.prompts_file else ""
    raise ValueError(f"{source}conversations of {turns} turns need config.chat (each turn is a chat message)")
  if cfg.output:
    check_output(cfg.output)
  return requests


@dataclasses.dataclass
class BuiltDrafter:
  """A drafter built for the loaded models, the facts recorded with its results, and what it learned
  from the runs so far (`Drafter.remember`: a pool drafter's pool; `run` stores the drafter it ends
  with). `specjax.Decoder` keeps one per drafter setting; its identity names the drafter's compiled
  programs, which the learning drafter (a new object of the same shapes) keeps using."""

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


@dataclasses.dataclass
class _Tally:
  """What a run's batches add up to: tokens, wall time, passes and acceptance (per turn, or merged)."""

  tokens: int = 0
  walls: list[float] = dataclasses.field(default_factory=list)  # seconds per batch
  target_calls: int = 0
  draft_calls: int = 0
  acceptance: list = dataclasses.field(default_factory=list)  # per batch: `metrics` counters of its real rows
  rounds_per_length: Any = 0  # [C] rounds that chose each proposal length (speculative)

  def add(self, spec: DecodeSpec, out, wall: float, counts_B: np.ndarray) -> list[dict] | None:
    """Counts one batch's output, whose real rows (the first ones; the rest are filler) generated `counts_B` tokens;
    returns the real rows' statistics (speculative)."""
    rows = len(counts_B)
    self.tokens += int(np.sum(counts_B))
    self.walls.append(wall)
    self.target_calls += int(out.target_calls)
    if not spec.speculative:
      return None
    self.draft_calls += int(out.draft_calls)
    self.rounds_per_length = self.rounds_per_length + meshes.to_host(out.rounds_per_length)
    self.acceptance.append(jax.tree.map(lambda a: a[:rows], meshes.to_host(out.acceptance)))
    return metrics.summarize(self.acceptance[-1])["per_row"]

  @staticmethod
  def merged(tallies: Sequence[_Tally]) -> _Tally:
    return _Tally(sum(t.tokens for t in tallies), [w for t in tallies for w in t.walls],
                  sum(t.target_calls for t in tallies), sum(t.draft_calls for t in tallies),
                  [a for t in tallies for a in t.acceptance], sum(t.rounds_per_length for t in tallies))

  def stats(self, spec: DecodeSpec) -> dict[str, Any]:
    wall = sum(self.walls)
    stats = {"generated_tokens": self.tokens, "wall_time_s": wall, "tokens_per_second": self.tokens / wall,
             "target_calls": self.target_calls}
    if spec.speculative:
      totals = metrics.summarize(jax.tree.map(lambda *a: np.concatenate(a), *self.acceptance))["total"]
      stats.update(draft_calls=self.draft_calls, acceptance_rate=totals["acceptance_rate"],
                   alpha_hat=totals["alpha_hat"], mean_accepted_length=totals["mean_accepted_length"],
                   per_position_acceptance=totals["position_acceptance_rate"], acceptance=totals,
                   jump_forward_share=totals["jump_forward"] / max(self.tokens, 1),
                   k_policy={"rounds_per_length": [int(n) for n in self.rounds_per_length]})
    return stats


def _lowering_report(spec: DecodeSpec, runner: Runner, padded: np.ndarray, lengths: np.ndarray, key,
                     models: tuple[LoadedModel, LoadedModel | None], log: Callable[[str], None]) -> dict[str, Any]:
  """`config.lower_only`: the run's program lowered for that platform and read (`lowering.report`),
  written like decode results under "programs"; nothing runs."""
  cfg = spec.config
  lowered = runner(padded, lengths, np.full(len(lengths), cfg.max_new_tokens, np.int32), key, lower=cfg.lower_only)
  program = {"name": cfg.mode, "platform": cfg.lower_only, "batch_size": cfg.batch_size,
             "cache_len": runner.cache_len, **lowering.report(lowered)}
  log(f"{cfg.mode} program lowered for {cfg.lower_only}: {program['while_loops_in_round']} data-dependent while "
      f"loop(s) in the round, {program['data_dependent_while_loops']} in all, custom calls "
      f"{program['custom_calls'] or 'none'}, {program['host_transfers']} host transfer(s)")
  results = {"config": cfg.as_configdict().to_dict(), "programs": [program],
             "environment": {**records.environment(), **devices_record(*models)}}
  if cfg.output and meshes.is_main_process():
    results["written_to"] = write_results(results, cfg.output, log)
  return results


def run(spec: DecodeSpec | ml_collections.ConfigDict, log: Callable[[str], None] = print,
        models: tuple[LoadedModel, LoadedModel | None] | None = None,
        drafter: BuiltDrafter | None = None,
        policy_memory: dict[tuple, k_policy.Memory] | None = None, warm: set | None = None,
        requests: Sequence[prompts.Request] | None = None) -> dict[str, Any]:
  """Decodes `requests`, else every prompt of `spec` (or of a config, checked into one); returns the
  JSON-ready results, also written to `config.output` (or, when that fails at the end, to the fallback
  file named by `results["written_to"]`).

  `models` = (target, draft or None) already loaded and `drafter` (built, and updated with what this
  run's batches teach it: `Drafter.remember`) reuse what an earlier run loaded or built (`specjax.Decoder`, benchmarks and sweeps); `policy_memory` keeps
  the adaptive policy's measured cost table (measured once) and learned acceptance across runs, one
  `k_policy.Memory` per compiled program; `warm` holds the programs an earlier run already compiled and
  ran (`DecodeSpec.program`), which skip the warm-up call (compile_time_s 0), and gains this run's."""
  spec = spec if isinstance(spec, DecodeSpec) else from_config(spec)
  cfg = spec.config
  log = log if meshes.is_main_process() else lambda message: None
  requests = check_inputs(spec, requests)
  load_start = time.perf_counter()
  target, draft = models or load_models(spec, log)
  load_time = time.perf_counter() - load_start
  built = (drafter or build_drafter(spec, target, draft, log)) if spec.speculative else None
  drafter_info = built.info if built else {}

  tok = target.tokenizer
  width = prompts.width_bound(tok, requests, cfg.chat, cfg.max_new_tokens)
  # One shape for all batches of every turn, with room for a verify pass past the budget.
  cache_len = -(-(width + cfg.max_new_tokens + spec.verify_width) // 64) * 64
  runner = Runner(spec, target, built and built.drafter, cache_len)
  constraints = _constraints(spec, requests, target)

  def constrain(rows: list[int]) -> None:
    """The runner's constraint for a batch of these requests (padding rows unconstrained)."""
    if constraints is not None:
      specs = [_constraint(spec, requests[i]) for i in rows]
      runner.constraint = constraints.rows(specs + [""] * (cfg.batch_size - len(specs)))

  key = jax.random.key(cfg.seed)
  first = [prompts.turn_ids(tok, r, (), cfg.chat) for r in requests[:cfg.batch_size]]
  _, padded, lengths = next(_batches(first, cfg.batch_size, width))
  constrain(list(range(len(first))))
  if cfg.lower_only:
    return _lowering_report(spec, runner, padded, lengths, key, (target, draft), log)
  # The requests' constraints (a runtime field) still shape the program: their table's.
  table_shape = None if constraints is None else constraints.next_ZxV.shape
  program, compile_time = (*spec.program(cache_len, width), id(built), table_shape), 0.0
  if warm is None or program not in warm:
    log(f"compiling the {cfg.mode} program (batch {cfg.batch_size}, cache {cache_len}) ...")
    start = time.perf_counter()
    jax.block_until_ready(runner(padded, lengths, np.full(len(lengths), min(2, cfg.max_new_tokens), np.int32),
                                 key).tokens)
    compile_time = time.perf_counter() - start
    if warm is not None:
      warm.add(program)
  profiler = round_profile.Profiler() if cfg.profile else None
  policy_memory = {} if policy_memory is None else policy_memory  # this run's batches share one
  policy_record, cost_checks = {}, []  # cost_checks: the cost table against each call long enough to check
  if spec.speculative:
    tuned_program = (*spec.program(cache_len), id(built), table_shape)
    policy_record = _tune(spec, runner, policy_memory, (padded, lengths), key, log, tuned_program)

  turns = max(len(r.turns) for r in requests)
  answers: list[list[str]] = [[] for _ in requests]
  outputs, per_turn, batch_number = [], [], 0
  for turn in range(turns):
    active = [i for i, r in enumerate(requests) if len(r.turns) > turn]
    prompt_ids = [prompts.turn_ids(tok, requests[i], answers[i], cfg.chat) for i in active]
    if max(map(len, prompt_ids)) > width:
      raise RuntimeError(f"turn {turn + 1}: a prompt of {max(map(len, prompt_ids))} tokens exceeds the {width} "
                         f"the program was compiled for (an earlier answer re-encoded to more than its budget + "
                         f"{prompts.ANSWER_SLACK} tokens)")
    tally = _Tally()
    for indices, padded, lengths in _batches(prompt_ids, cfg.batch_size, width):
      batch_number += 1
      log(f"{f'turn {turn + 1}/{turns}, ' if turns > 1 else ''}batch {len(tally.walls) + 1}/"
          f"{-(-len(active) // cfg.batch_size)} ...")
      budget = np.where(np.arange(len(lengths)) < len(indices), cfg.max_new_tokens, 1).astype(np.int32)
      constrain([active[j] for j in indices])
      start = time.perf_counter()
      out = runner(padded, lengths, budget, jax.random.fold_in(key, batch_number - 1))
      tokens, counts = meshes.to_host((out.tokens, out.counts))
      wall = time.perf_counter() - start
      per_row = tally.add(spec, out, wall, counts[:len(indices)])
      if profiler is not None:
        profiler.batch(runner, padded, lengths, jax.random.fold_in(key, batch_number - 1), out, wall)
      if runner.memory is not None:  # the cost table held against what the call cost; a miss measures it again
        check = runner.memory.check(meshes.to_host(out.rounds_per_length), wall)
        if check is not None:
          cost_checks.append(check)
          # Measured again once per run at most: a machine whose load keeps changing would measure forever.
          if check["stale"] and not policy_record["remeasured_after_a_miss"]:
            log(f"the round costs predicted {check['predicted_s']:.2f} s for this batch; it took {wall:.2f} s")
            policy_record = _tune(spec, runner, policy_memory, (padded, lengths), key, log, tuned_program)
      if built:  # what the real rows (not the filler) decoded, for the next batch, turn and run
        real_B = np.arange(len(lengths)) < len(indices)
        runner.drafter = built.drafter = built.drafter.remember(padded, np.where(real_B, lengths, 0), out.tokens,
                                                                np.where(real_B, counts, 0))
      for row, j in enumerate(indices):
        i = active[j]
        ids = [int(t) for t in tokens[row, :counts[row]]]
        answers[i].append(prompts.answer_text(tok, ids))
        outputs.append({"prompt": requests[i].turns[turn], "prompt_tokens": len(prompt_ids[j]),
                        "text": tok.decode(ids), "token_ids": ids, "num_tokens": len(ids),
                        "batch_wall_time_s": wall, **({"conversation": i, "turn": turn + 1} if turns > 1 else {}),
                        **requests[i].meta, **({"constraint": own} if (own := requests[i].constraint) else {}),
                        **({"stats": per_row[row]} if spec.speculative else {})})
    per_turn.append(tally)
  outputs.sort(key=lambda o: o.get("conversation", 0))  # conversation by conversation, turns in order (stable)

  stats = {"mode": cfg.mode, "num_prompts": len(outputs), **_Tally.merged(per_turn).stats(spec),
           "compile_time_s": compile_time, "load_time_s": load_time}
  if spec.speculative:
    checks = {"cost_checks": cost_checks} if spec.policy.tuned else {}
    stats.update(k_policy={**policy_record, **stats.pop("k_policy"), **checks}, **drafter_info)
    if "tree_nodes" in drafter_info:  # a tree: positions are depths; a round verifies the tree cut at its depth
      verified = tuning.nodes_verified_per_round(spec.tree, drafter_info["tree_nodes"], stats["k_policy"])
      mean = stats["mean_accepted_length"]
      stats.update(nodes_verified_per_round=verified,
                   accepted_per_verified_node=None if mean is None else mean / verified)
  if profiler is not None:
    stats["profile"] = profiler.report(runner, width)
    for line in round_profile.lines(stats["profile"]):
      log(line)
  if turns > 1:
    stats["turns"] = [{"turn": t + 1, **tally.stats(spec)} for t, tally in enumerate(per_turn)]
  results = {"config": cfg.as_configdict().to_dict(), "stats": stats, "outputs": outputs,
             "environment": {**records.environment(), **devices_record(target, draft)}}
  if cfg.output and meshes.is_main_process():
    results["written_to"] = write_results(results, cfg.output, log)
  return results
