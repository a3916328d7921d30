"""From a decode config to generated texts and statistics: the library behind `python -m specjax.decode`.

It loads the models, checks that draft and target speak the same token language, encodes the prompts
(optionally through the chat template), runs them in fixed-size batches through one compiled program
(speculative or autoregressive) of a `specjax.session.Session`, turn by turn, and gathers per-prompt
outputs and aggregate statistics. The first call of each program runs with a 2-token budget to compile
it and run its loop body once (`Session.warm_up`), so throughput excludes both and compile time (that
call) is reported on its own.

With `mesh` set the weights load straight into their shards on a `jax.sharding.Mesh`, the caches are
allocated sharded, prompts and per-row state are split over `data`, and the programs run under
`jax.set_mesh` (GSPMD partitions them; see `specjax.partitioning`). In a multi-process run every
process runs the same calls; only process 0 logs and writes results.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np

from specjax import lowering, mesh as meshes, metrics, partitioning, prompts, records, round_profile
from specjax.decode_spec import DecodeSpec, from_config
from specjax.errors import ConfigError
from specjax.models import matmul, quantized
from specjax.models.load import LoadedModel, load_model, with_execution
from specjax.session import Batch, Decoded, Models, Row, Session, Sessions, constraint_of
from specjax.speculative.k_policy import tuning


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
    log(f"loading target {cfg.target} ({cfg.dtype}{_weights_note(cfg.weights)}"
        f"{f'; {spec.dtype_note}' if spec.dtype_note else ''}) ...")
    target = with_execution(_load(cfg.target, cfg.dtype, target_part, cfg.weights, "config.weights"), spec.execution,
                            target_part)
  draft = None
  if spec.loads_draft_model:
    draft_part = None if target.part is None else dataclasses.replace(target.part, name="draft")
    draft_part = draft_part.replicated() if draft_part and cfg.draft_sharding == "replicated" else draft_part
    field = spec.drafter_settings.field("weights")
    log(f"loading draft {cfg.draft} ({cfg.dtype}{_weights_note(spec.draft_weights)}) ...")
    draft = with_execution(_load(cfg.draft, cfg.dtype, draft_part, spec.draft_weights, field), spec.draft_execution,
                           draft_part)
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
  for request in requests:
    request.check_budget(cfg.max_new_tokens)
  turns = max(len(r.turns) for r in requests)
  if turns > 1 and not cfg.chat:
    source = f"config.prompts_file {cfg.prompts_file}: " if cfg.prompts_file else ""
    raise ValueError(f"{source}conversations of {turns} turns need config.chat (each turn is a chat message)")
  if cfg.output:
    records.check_output(cfg.output)
  return requests


def _lowering_report(spec: DecodeSpec, session: Session, batch: Batch, key, models: Models,
                     log: Callable[[str], None]) -> dict[str, Any]:
  """`config.lower_only`: the run's program lowered for that platform and read (`lowering.report`),
  written like decode results under "programs"; nothing runs."""
  cfg = spec.config
  lowered = session(batch.with_budget(cfg.max_new_tokens), key, lower=cfg.lower_only)
  program = {
      "name": cfg.mode, "platform": cfg.lower_only, "batch_size": cfg.batch_size, "cache_len": session.cache_len,
      **lowering.report(lowered)
  }
  log(f"{cfg.mode} program lowered for {cfg.lower_only}: {program['while_loops_in_round']} data-dependent while "
      f"loop(s) in the round, {program['data_dependent_while_loops']} in all, custom calls "
      f"{program['custom_calls'] or 'none'}, {program['host_transfers']} host transfer(s)")
  results = {
      "config": cfg.as_configdict().to_dict(), "programs": [program],
      "environment": {**records.environment(), **devices_record(*models)}
  }
  if cfg.output and meshes.is_main_process():
    results["written_to"] = records.write_results(results, cfg.output, log)
  return results


def _row(session: Session, request: prompts.Request, answers: Sequence[str]) -> Row:
  """The batch row of `request`'s turn after `answers` (the model's answers so far)."""
  spec = session.spec
  return Row(prompts.turn_ids(session.target.tokenizer, request, answers, spec.config.chat),
             constraint_of(spec, request), request.budget(spec.config.max_new_tokens), request.knobs(spec.knobs))


@dataclasses.dataclass
class _Turns:
  """A run's requests decoded turn by turn, batch by batch, through its session: their outputs (conversation
  by conversation), a tally per turn, the policy's record (measured again once at most, after a call its
  cost table missed) and every call's cost check."""

  session: Session  # its spec is the run's
  width: int
  policy: dict[str, Any]
  outputs: list[dict] = dataclasses.field(default_factory=list)
  tallies: list[metrics.Tally] = dataclasses.field(default_factory=list)
  cost_checks: list[dict] = dataclasses.field(default_factory=list)

  def decode(self, requests: Sequence[prompts.Request], key, profiler, log: Callable[[str], None]) -> None:
    spec, tok = self.session.spec, self.session.target.tokenizer
    size = spec.config.batch_size
    turns = max(len(r.turns) for r in requests)
    answers: list[list[str]] = [[] for _ in requests]
    for turn in range(turns):
      active = [i for i, r in enumerate(requests) if len(r.turns) > turn]
      rows = [_row(self.session, requests[i], answers[i]) for i in active]
      if max(len(r.ids) for r in rows) > self.width:
        raise RuntimeError(f"turn {turn + 1}: a prompt of {max(len(r.ids) for r in rows)} tokens exceeds the "
                           f"{self.width} the program was compiled for (an earlier answer re-encoded to more than "
                           f"its budget + {prompts.ANSWER_SLACK} tokens)")
      self.tallies.append(tally := metrics.Tally())
      for start in range(0, len(active), size):
        log(f"{f'turn {turn + 1}/{turns}, ' if turns > 1 else ''}batch {start // size + 1}/{-(-len(active) // size)}"
            f" ...")
        batch = self.session.batch(rows[start:start + size], self.width)
        batch_key = jax.random.fold_in(key, sum(len(t.walls) for t in self.tallies))  # batches before it
        decoded = self.session.generate(batch, batch_key, profiler)
        counts = np.array([len(ids) for ids in decoded.token_ids])
        per_row = tally.add(spec.speculative, decoded.out, decoded.wall_s, counts)
        self._check(decoded, batch, key, log)
        for row, i in enumerate(active[start:start + size]):
          ids = decoded.token_ids[row]
          answers[i].append(prompts.answer_text(tok, ids))
          self.outputs.append({
              "prompt": requests[i].turns[turn], "prompt_tokens": len(rows[start + row].ids),
              "text": tok.decode(ids, skip_special_tokens=True), "token_ids": ids, "num_tokens": len(ids),
              "batch_wall_time_s": decoded.wall_s, **({"conversation": i, "turn": turn + 1} if turns > 1 else {}),
              **requests[i].meta, **requests[i].own_settings(), **({"stats": per_row[row]} if spec.speculative else {})
          })
    self.outputs.sort(key=lambda o: o.get("conversation", 0))  # conversation by conversation, turns in order

  def _check(self, decoded: Decoded, batch: Batch, key, log: Callable[[str], None]) -> None:
    """Keeps the call's cost check; a miss measures the table again (once per run at most: a machine
    whose load keeps changing would measure forever)."""
    check = decoded.cost_check
    if check is None:
      return
    self.cost_checks.append(check)
    if check["stale"] and not self.policy["remeasured_after_a_miss"]:
      log(f"the round costs predicted {check['predicted_s']:.2f} s for this batch; it took {decoded.wall_s:.2f} s")
      self.policy.update(self.session.tune(batch, key, log))

  def stats(self) -> dict[str, Any]:
    """The run's statistics over every turn (without its compile and load times)."""
    spec, built = self.session.spec, self.session.built
    stats = {
        "mode": spec.config.mode, "num_prompts": len(self.outputs),
        **metrics.Tally.merged(self.tallies).stats(spec.speculative)
    }
    if spec.speculative:
      checks = {"cost_checks": self.cost_checks} if spec.policy.tuned else {}
      stats.update(k_policy={**self.policy, **stats.pop("k_policy"), **checks}, **built.info)
      if "tree_nodes" in built.info:  # a tree: positions are depths; a round verifies the tree cut at its depth
        verified = tuning.nodes_verified_per_round(spec.tree, built.info["tree_nodes"], stats["k_policy"])
        mean = stats["mean_accepted_length"]
        stats.update(nodes_verified_per_round=verified,
                     accepted_per_verified_node=None if mean is None else mean / verified)
    if len(self.tallies) > 1:
      stats["turns"] = [{"turn": t + 1, **tally.stats(spec.speculative)} for t, tally in enumerate(self.tallies)]
    return stats


def run(spec: DecodeSpec | ml_collections.ConfigDict, log: Callable[[str], None] = print, models: Models | None = None,
        sessions: Sessions | None = None, requests: Sequence[prompts.Request] | None = None) -> dict[str, Any]:
  """Decodes `requests`, else every prompt of `spec` (or of a config, checked into one); returns the
  JSON-ready results, also written to `config.output` (or, when that fails at the end, to the fallback
  file named by `results["written_to"]`).

  `models` = (target, draft or None) already loaded, or `sessions` over them, reuse what earlier runs
  loaded, built and learned (`specjax.Decoder`, benchmarks and sweeps): a session's program compiled
  and warmed, its caches, the adaptive policy's measured cost table and learned acceptance, the
  drafter's pool (`specjax.session`)."""
  spec = spec if isinstance(spec, DecodeSpec) else from_config(spec)
  cfg = spec.config
  log = log if meshes.is_main_process() else lambda message: None
  requests = check_inputs(spec, requests)
  load_start = time.perf_counter()
  sessions = sessions or Sessions(models or load_models(spec, log), log=log)
  load_time = time.perf_counter() - load_start
  session, width = sessions.open(spec, requests)
  key = jax.random.key(cfg.seed)
  first = session.batch([_row(session, r, ()) for r in requests[:cfg.batch_size]], width)
  if cfg.lower_only:
    return _lowering_report(spec, session, first, key, sessions.models, log)
  compile_time = session.warm_up(first, key, log)
  profiler = round_profile.Profiler() if cfg.profile else None
  turns = _Turns(session, width, session.tune(first, key, log) if spec.speculative else {})
  turns.decode(requests, key, profiler, log)
  stats = {**turns.stats(), "compile_time_s": compile_time, "load_time_s": load_time}
  if profiler is not None:
    stats["profile"] = profiler.report(session, width)
    for line in round_profile.lines(stats["profile"]):
      log(line)
  results = {
      "config": cfg.as_configdict().to_dict(), "stats": stats, "outputs": turns.outputs,
      "environment": {**records.environment(), **devices_record(*sessions.models)}
  }
  if cfg.output and meshes.is_main_process():
    results["written_to"] = records.write_results(results, cfg.output, log)
  return results
