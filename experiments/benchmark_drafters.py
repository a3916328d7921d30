"""Drafter benchmark: specjax autoregressive decoding against every drafter, on three prompt sets, in one
run, one JSON file, markdown tables.

  python -m experiments.benchmark_drafters --config=configs/benchmarks/drafters.py [--config.FIELD=...]
  python -m experiments.benchmark_drafters --config=configs/benchmarks/drafters.py \
      --config.report=experiments/results/drafters_cpu_float32.json   # the tables of a results file

Prompt sets (configs/benchmarks/drafters.py chooses which systems run on which):
  code_edit  input-grounded chat prompts: edit a standard-library function and return it whole, so
             the answer mostly repeats the prompt (configs/code_edit_prompts.py)
  chat       open-ended coding requests (experiments/benchmark_decode.py PROMPTS)
  raw        the first lines of standard-library functions, continued as plain text (no chat template)
  readme     the two coding requests of the README's command (configs/qwen_coder.py)
  mtbench    MT-Bench first turns, one question per category in file order (`python -m specjax.data
             fetch mt-bench` first)
Each set runs in up to three regimes: `greedy` (batch 1, temperature 0), `sampled` (batch 1,
`sampled_temperature`) and `batched` (`batched_size`, greedy). A (set, regime) group runs specjax
autoregressive decoding first, again after every `ar_every` speculative systems and last, and divides
each system's tokens/s by the mean of those runs (`speedup_vs_autoregressive`; the machine's speed
drifts over a long run, which the spread of the baseline shows; `speedup_vs_adjacent_autoregressive`
divides by the baseline runs just before and after instead). Every run is `specjax.pipeline.run` on
the models loaded once: compile time (a first 2-token call) is recorded apart from throughput, and
tokens/s includes each prompt's prefill. Greedy outputs of every speculative run are compared token
for token with the group's autoregressive output and the result recorded (never asserted: a mismatch
is a finding to report, not a reason to lose the run).

Costs, measured once before the runs, per batch size: the target's forward time for T = 1 and K + 1
tokens (`costs.forward_seconds`), whose ratio is the verify cost of a round; and each drafter's cost
ratio c (`costs.drafter_cost_ratio`: 0 for n-gram lookup). Per run: the speedup Leviathan et al.'s formula
predicts at the measured alpha_hat with the verify pass costing one step (`theoretical_speedup`) and
with its measured cost (`modelled_speedup`). The formula assumes K proposals every round; for n-gram
lookup (rounds without a match propose nothing and run a 1-token pass) and early-stopped drafts it is
an approximation.

`transformers` (batch 1, greedy, same input ids, after the specjax runs and with specjax's models
released): plain `generate` and prompt lookup (`prompt_lookup_num_tokens` = ngram_k,
`max_matching_ngram_size` = drafters.ngram.max) on `transformers_set`, timed per prompt after a short warm-up.

The JSON (`output`) is rewritten after every measurement, so a killed run keeps what it measured; it
holds the command (from the repository root), machine and versions, the config, the prompts, the costs,
one row per run (stats, c, verify cost, speedups, output token ids) and the transformers rows.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import time
from typing import Callable, Sequence

import jax
import ml_collections
import numpy as np

from configs import code_edit_prompts, qwen_coder
from experiments import benchmark_decode, harness, hf_reference
from experiments.harness import number
from specjax import costs, decode_spec, metrics, pipeline, prompts, records, session
from specjax.api import apply_fields
from specjax.decode_config import default_config
from specjax.speculative.drafters import registry
from specjax.speculative import k_policy
from specjax.speculative.trees import tree as tree_lib
from specjax.errors import ConfigError
from specjax.models.load import LoadedModel

SETS = ("code_edit", "chat", "raw", "readme", "mtbench")
AUTOREGRESSIVE = "autoregressive"
Log = Callable[[str], None]


def set_prompts(name: str, cfg: ml_collections.ConfigDict) -> list[str]:
  """Every prompt of the set `name`, in order (a run takes the first `num_prompts`)."""
  if name == "code_edit":
    return code_edit_prompts.code_edit_prompts()
  if name == "chat":
    return list(benchmark_decode.PROMPTS)
  if name == "readme":
    return list(qwen_coder.get_config().prompts)
  if name == "mtbench":
    return [c.turns[0] for c in prompts.requests((), prompts.MT_BENCH + "?per_category=1")]
  return code_edit_prompts.continuation_prompts(cfg.continuation_lines)


@dataclasses.dataclass(frozen=True)
class System:
  """One decoding setup: specjax autoregressive, or a drafter with its K (and early-stop threshold)."""

  drafter: str  # AUTOREGRESSIVE, or a `config.drafter` value: a registered name or package.module:Class
  k: int = 1
  threshold: float = 0.0  # model.stop_threshold of the model drafter (0 = off)
  policy: str = "fixed"  # config.k_policy: "fixed" (K every round) or "adaptive" (K the most)
  draft: str = ""  # an alias of the benchmark's `other_drafts`: the draft model it loads ("" = `draft`)
  tree: str = ""  # an alias of the benchmark's `trees`: the static tree it drafts, K its depth ("" = a chain)

  @property
  def speculative(self) -> bool:
    return self.drafter != AUTOREGRESSIVE

  @property
  def source(self) -> str:
    """The drafter with its draft model's alias: what a cost ratio c is measured for ("model@qwen05b")."""
    return self.drafter + (f"@{self.draft}" if self.draft else "")

  @property
  def name(self) -> str:
    """The system's name in the results: "autoregressive", "ngram_k8", "model_k8_t0.5", "model_k8_adaptive",
    "model@qwen05b_k3"..."""
    if not self.speculative:
      return AUTOREGRESSIVE
    return (self.source + (f"+{self.tree}" if self.tree else f"_k{self.k}") +
            (f"_t{self.threshold:g}" if self.threshold else "") + ("_adaptive" if self.policy == "adaptive" else ""))

  def verified(self, cfg: ml_collections.ConfigDict) -> int:
    """Draft tokens a round verifies at most: K, or the tree's nodes."""
    return tree_lib.parse(cfg.trees[self.tree]).nodes_with_root - 1 if self.tree else self.k

  def label(self, cfg: ml_collections.ConfigDict) -> str:
    """The system as the tables name it."""
    if not self.speculative:
      return "specjax autoregressive"
    k = f"K<={self.k} adaptive" if self.policy == "adaptive" else f"K={self.k}"
    if self.drafter == "ngram":
      return f"ngram {k} (n={cfg.drafters.ngram.min}..{cfg.drafters.ngram.max})"
    if self.drafter == "layer_skip":
      return f"layer_skip {k} (layers {cfg.drafters.layer_skip.layers})"
    draft = f" ({self.draft})" if self.draft else ""
    if self.tree:
      k = f"depth<={self.k} adaptive" if self.policy == "adaptive" else f"depth {self.k}"
      return f"{self.drafter}{draft} tree {cfg.trees[self.tree]}, {k}"
    if self.drafter == "model":
      return f"model{draft} {k}" + (f", stop below {self.threshold:g}" if self.threshold else "")
    return f"{self.drafter}{draft} {k}"


_SYSTEM = re.compile(r"([\w.:]+?)(?:@([A-Za-z0-9.-]+))?(?:\+([A-Za-z0-9.-]+)|_k(\d+))?(?:_t(\d*\.?\d+))?(_adaptive)?")


def parse_systems(names: Sequence[str], cfg: ml_collections.ConfigDict, where: str) -> list[System]:
  """The systems named in `names` (see configs/benchmarks/drafters.py), "model" expanded to every K of
  `model_ks` and every threshold of `thresholds` at `threshold_k`. Fails naming `where` (the field)."""
  systems = []
  draft_weights = cfg.get("draft_weights") or {}  # benchmarks built on other configs (MT-Bench) have none
  for alias in draft_weights:
    if alias not in (cfg.get("other_drafts") or {}):
      raise ConfigError(f"config.draft_weights.{alias}: no config.other_drafts.{alias} to apply it to")
  for name in names:
    match = _SYSTEM.fullmatch(str(name))
    known = match and (match[1] in registry.names() or ":" in match[1])
    if not known or (match[5] and match[1] != "model"):
      raise ConfigError(f"{where}: unknown system {name!r}; expected a drafter ({', '.join(registry.names())} or "
                        f"package.module:Class), alone or with a K such as ngram_k4 or model_k5, or model_k8_t0.5 "
                        f"(K 8, stop threshold 0.5), and _adaptive for the adaptive K policy (model_k8_adaptive); "
                        f"model@ALIAS_k5 drafts with the model config.other_drafts.ALIAS, model+ALIAS the tree "
                        f"config.trees.ALIAS")
    drafter, draft, tree, k, threshold = match[1], match[2] or "", match[3] or "", match[4], match[5]
    policy = "adaptive" if match[6] else "fixed"
    for alias, field in ((draft, "other_drafts"), (tree, "trees")):
      known = cfg.get(field) or {}
      if alias and alias not in known:
        raise ConfigError(f"{where}: system {name!r} names {alias!r}, which config.{field} lacks "
                          f"(it has: {', '.join(known) or 'none'})")
    if tree:
      depth = tree_lib.parse(cfg.trees[tree]).max_depth
      systems.append(System(drafter, depth, float(threshold or 0.0), policy, draft, tree))
      continue
    if drafter == "model" and k is None and policy == "fixed":
      systems += [System("model", int(model_k), draft=draft) for model_k in cfg.model_ks]
      systems += [System("model", int(cfg.threshold_k), float(t), draft=draft) for t in cfg.thresholds]
      continue
    default_k = {"ngram": cfg.ngram_k, "layer_skip": cfg.layer_skip_k}.get(drafter, cfg.default_k)
    systems.append(System(drafter, int(k if k is not None else default_k), float(threshold or 0.0), policy, draft))
  return list(dict.fromkeys(systems))  # once each, in order


@dataclasses.dataclass
class Group:
  """The runs of one prompt set in one regime: one baseline, many systems."""

  prompt_set: str
  regime: str  # "greedy" | "sampled" | "batched"
  batch_size: int
  temperature: float
  chat: bool
  prompts: tuple[str, ...]
  systems: list[System]

  @property
  def key(self) -> str:
    return f"{self.prompt_set}/{self.regime}"

  def decode_config(self, cfg: ml_collections.ConfigDict, system: System) -> ml_collections.ConfigDict:
    """The `pipeline.run` config of `system` in this group."""
    return decode_config(cfg, system, prompts=self.prompts, chat=self.chat, batch_size=self.batch_size,
                         temperature=self.temperature)


def decode_config(cfg: ml_collections.ConfigDict, system: System, **fields) -> ml_collections.ConfigDict:
  """The `pipeline.run` config of `system` under a benchmark config `cfg` (its target, draft, dtype,
  budget, seed and drafter groups), with `fields` (the prompts, batch size, temperature...) set."""
  groups = {name: group.to_dict() for name, group in cfg.drafters.items()}
  if system.drafter == "model":
    groups["model"] = {**groups.get("model", {}), "stop_threshold": system.threshold}
    if system.draft in (cfg.get("draft_weights") or {}):
      groups["model"]["weights"] = cfg.draft_weights[system.draft]
  return apply_fields(
      default_config(),
      dict(target=cfg.target, draft=cfg.other_drafts[system.draft] if system.draft else cfg.draft, dtype=cfg.dtype,
           max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, profile=cfg.profile,
           mode="speculative" if system.speculative else AUTOREGRESSIVE, k=system.k, k_policy=system.policy,
           tree=cfg.trees[system.tree] if system.tree else "",
           **({"drafter": system.drafter} if system.speculative else {}), **groups, **fields))


def plan(cfg: ml_collections.ConfigDict, log: Log) -> list[Group]:
  """Every group to run, in order, each system's decode config validated: a bad value fails here,
  before any model loads. layer_skip systems are dropped while `drafters.layer_skip.layers` is empty."""
  def require(ok: bool, message: str) -> None:
    if not ok:
      raise ConfigError(message)

  require(bool(cfg.prompt_sets), "config.prompt_sets is empty")
  for name in cfg.prompt_sets:
    require(name in SETS, f"config.prompt_sets: unknown set {name!r}; known: {', '.join(SETS)}")
  require(
      int(cfg.ar_every) == cfg.ar_every and cfg.ar_every >= 1,
      f"config.ar_every must be an integer >= 1, got {cfg.ar_every}")
  require(cfg.cost_repeats >= 1, f"config.cost_repeats must be >= 1, got {cfg.cost_repeats}")
  require(
      int(cfg.repeats) == cfg.repeats and cfg.repeats >= 1, f"config.repeats must be an integer >= 1, "
      f"got {cfg.repeats}")
  require(cfg.batched_size >= 1, f"config.batched_size must be >= 1, got {cfg.batched_size}")
  require(cfg.large_batch_size >= 1, f"config.large_batch_size must be >= 1, got {cfg.large_batch_size}")
  require(cfg.continuation_lines >= 1, f"config.continuation_lines must be >= 1, got {cfg.continuation_lines}")
  require(not cfg.transformers or cfg.transformers_set in cfg.prompt_sets,
          f"config.transformers_set {cfg.transformers_set!r} is not among config.prompt_sets")
  groups, skipped = [], []
  for name in cfg.prompt_sets:
    settings, texts = cfg.sets[name], set_prompts(name, cfg)
    regimes = (("greedy", 1, 0.0), ("sampled", 1, float(cfg.sampled_temperature)),
               ("batched", int(cfg.batched_size), 0.0), ("batched_large", int(cfg.large_batch_size), 0.0))
    for regime, batch_size, temperature in regimes:
      where = f"config.sets.{name}.{regime}"
      systems = parse_systems(settings[regime], cfg, where)
      if not cfg.drafters.layer_skip.layers:
        skipped += [f"{name}/{regime}" for s in systems if s.drafter == "layer_skip"]
        systems = [s for s in systems if s.drafter != "layer_skip"]
      if not systems:
        continue
      require(settings.num_prompts >= 1, f"config.sets.{name}.num_prompts must be >= 1")
      count = -(-max(settings.num_prompts, batch_size) // batch_size) * batch_size  # whole batches
      require(
          count <= len(texts), f"{where}: {count} prompts needed (num_prompts "
          f"{settings.num_prompts}, batch {batch_size}), the set has {len(texts)}")
      group = Group(name, regime, batch_size, temperature, bool(settings.chat), tuple(texts[:count]), systems)
      for system in [System(AUTOREGRESSIVE), *systems]:
        try:
          spec = decode_spec.from_config(group.decode_config(cfg, system))
        except ConfigError as e:
          raise ConfigError(f"{where}, system {system.name}: {e}") from None
        require(not system.draft or spec.loads_draft_model,
                f"{where}, system {system.name}: its drafter loads no draft model, so @{system.draft} means nothing")
      groups.append(group)
  require(not cfg.transformers or any(g.prompt_set == cfg.transformers_set for g in groups),
          f"config.transformers_set {cfg.transformers_set!r} has no runs: its input ids and baseline come from them")
  if skipped:
    log(f"skipping layer_skip in {', '.join(skipped)}: config.drafters.layer_skip.layers is empty")
  require(bool(groups), "nothing to run: no prompt set has a system")
  return groups


def run_order(group: Group, ar_every: int, repeats: int = 1) -> list[System]:
  """The group's runs: the baseline first, after every `ar_every` systems and after the last; the
  systems and their baselines `repeats` times over (an A/B that averages the machine's drift)."""
  order = [System(AUTOREGRESSIVE)]
  for _ in range(repeats):
    for count, system in enumerate(group.systems, 1):
      order.append(system)
      if count % ar_every == 0 or count == len(group.systems):
        order.append(System(AUTOREGRESSIVE))
  return order


# ----------------------------------------------------------------------------------------------- costs


def measure_costs(cfg: ml_collections.ConfigDict, groups: list[Group], target: LoadedModel,
                  drafts: dict[str, LoadedModel | None], log: Log) -> dict:
  """Per batch size: the target's T-token forward times for T = 1 and every K + 1 used, the verify cost
  of each K (T = K + 1 over T = 1), and each drafter's c (measured once per drafter, draft model and batch
  size, keyed by `System.source`; the model drafter's c does not depend on K or on its stop threshold).
  `drafts`: the loaded draft models by alias ("" = `draft`)."""
  forward_s, verify_cost, c = {}, {}, {}
  for batch_size in sorted({g.batch_size for g in groups}):
    systems = [(g, s) for g in groups if g.batch_size == batch_size for s in g.systems]
    widths = sorted({1} | {s.verified(cfg) + 1 for _, s in systems})
    log(f"timing target forwards of T = {widths} tokens at batch {batch_size} ...")
    seconds = costs.forward_seconds(target.config, target.params, widths, cfg.cost_repeats, batch_size=batch_size)
    forward_s[str(batch_size)] = {str(T): s for T, s in seconds.items()}
    verify_cost[str(batch_size)] = {str(T - 1): s / seconds[1] for T, s in seconds.items() if T > 1}
    c[str(batch_size)] = {}
    for group, system in systems:
      if system.source not in c[str(batch_size)]:
        drafter = session.build_drafter(decode_spec.from_config(group.decode_config(cfg, system)), target,
                                        drafts[system.draft], log).drafter
        c[str(batch_size)][system.source] = costs.drafter_cost_ratio(drafter, target, batch_size, cfg.cost_repeats)
    log(f"batch {batch_size}: target T=1 {seconds[1] * 1e3:.0f} ms; verify cost " +
        " ".join(f"K={k}:{r:.2f}" for k, r in verify_cost[str(batch_size)].items()) + "; c " +
        " ".join(f"{d}:{v:.3f}" for d, v in c[str(batch_size)].items()))
  return {"target_forward_s": forward_s, "verify_cost": verify_cost, "cost_ratio_c": c}


# ------------------------------------------------------------------------------------------------ runs

_STATS = ("tokens_per_second", "wall_time_s", "compile_time_s", "generated_tokens", "num_prompts", "target_calls",
          "draft_calls", "acceptance_rate", "alpha_hat", "mean_accepted_length", "per_position_acceptance", "profile")


def make_row(cfg: ml_collections.ConfigDict, group: Group, system: System, result: dict, cost: dict) -> dict:
  """One run's record: its group, system, `pipeline.run` stats, costs, modelled speedups and outputs
  (speedups over the baseline and the greedy comparison are filled in by `derive`)."""
  stats = result["stats"]
  system_config = group.decode_config(cfg, system)
  loads_draft = decode_spec.from_config(system_config).loads_draft_model
  row = {
      "group": group.key, "prompt_set": group.prompt_set, "regime": group.regime, "batch_size": group.batch_size,
      "temperature": group.temperature, "system": system.name, "label": system.label(cfg),
      "drafter": system.drafter if system.speculative else None,
      "draft_model": records.relative(system_config.draft) if loads_draft else None,
      "k": system.k if system.speculative else None, "tree": cfg.trees[system.tree] if system.tree else None,
      "draft_stop_threshold": system.threshold if system.speculative else None, "k_policy": stats.get("k_policy"),
      **{field: stats.get(field) for field in _STATS}
  }
  row["prompt_tokens"] = [o["prompt_tokens"] for o in result["outputs"]]
  row["token_ids"] = [o["token_ids"] for o in result["outputs"]]
  if system.speculative:
    c = cost["cost_ratio_c"][str(group.batch_size)][system.source]
    verify = cost["verify_cost"][str(group.batch_size)][str(system.verified(cfg))]
    # The formula assumes a chain of K every round.
    alpha = None if system.policy == "adaptive" or system.tree else stats["alpha_hat"]
    if system.policy == "adaptive":  # the policy's own work per round, against the cheapest measured round
      policy = decode_spec.from_config(system_config).policy
      tree = tree_lib.parse(cfg.trees[system.tree]) if system.tree else None
      row["policy_step_s"] = costs.policy_step_seconds(policy, group.batch_size, system.k, tree)
      row["policy_share_of_cheapest_round"] = row["policy_step_s"] / min(stats["k_policy"]["cost_table_s"])
    row.update(cost_ratio_c=c, verify_cost=verify,
               theoretical_speedup=None if alpha is None else metrics.theoretical_speedup(alpha, system.k, c),
               modelled_speedup=None if alpha is None else metrics.theoretical_speedup(alpha, system.k, c, verify))
  else:
    row["texts"] = [o["text"] for o in result["outputs"]]
  return row


def derive(results: dict) -> None:
  """Fills in, from the runs recorded so far, each group's baseline (mean, runs, spread, whether its
  repeats agree) and each run's speedups over it and greedy comparison with its first output."""
  rows_by_group: dict[str, list[dict]] = {}
  for row in results["runs"]:
    rows_by_group.setdefault(row["group"], []).append(row)
  results["groups"] = {}
  for key, rows in rows_by_group.items():
    baseline = [r for r in rows if r["system"] == AUTOREGRESSIVE]
    speeds = [r["tokens_per_second"] for r in baseline]
    mean = float(np.mean(speeds)) if speeds else None
    reference = baseline[0]["token_ids"] if baseline else None
    results["groups"][key] = {
        "autoregressive_tokens_per_second": mean, "autoregressive_runs": speeds,
        "autoregressive_spread": (max(speeds) - min(speeds)) / mean if speeds else None,
        "autoregressive_outputs_agree": all(r["token_ids"] == reference for r in baseline) if baseline else None,
        "autoregressive_compile_time_s": baseline[0]["compile_time_s"] if baseline else None
    }
    for index, row in enumerate(rows):
      if row["system"] == AUTOREGRESSIVE:
        continue
      before = next((r for r in reversed(rows[:index]) if r["system"] == AUTOREGRESSIVE), None)
      after = next((r for r in rows[index + 1:] if r["system"] == AUTOREGRESSIVE), None)
      adjacent = [r["tokens_per_second"] for r in (before, after) if r is not None]
      row["speedup_vs_autoregressive"] = row["tokens_per_second"] / mean if mean else None
      row["speedup_vs_adjacent_autoregressive"] = (row["tokens_per_second"] /
                                                   float(np.mean(adjacent)) if adjacent else None)
      row["outputs_match_autoregressive"] = (row["token_ids"] == reference
                                             if row["temperature"] == 0 and reference is not None else None)
    results["groups"][key]["repeated"] = _repeated(rows)
  for row in results.get("transformers", []):
    baseline = [r for r in rows_by_group.get(row["group"], []) if r["system"] == AUTOREGRESSIVE]
    mean = results["groups"][row["group"]]["autoregressive_tokens_per_second"] if baseline else None
    row["speedup_vs_autoregressive"] = row["tokens_per_second"] / mean if mean else None
    row["outputs_match_autoregressive"] = row["token_ids"] == baseline[0]["token_ids"] if baseline else None


def _repeated(rows: list[dict]) -> dict[str, dict]:
  """Per system run more than once in a group (`repeats`): its runs' speedups over their adjacent
  baselines (the A/B estimate that the machine's drift disturbs least), mean, min and max."""
  ratios: dict[str, list[float]] = {}
  for row in rows:
    if row["system"] != AUTOREGRESSIVE and row.get("speedup_vs_adjacent_autoregressive") is not None:
      ratios.setdefault(row["system"], []).append(row["speedup_vs_adjacent_autoregressive"])
  return {
      system: {
          "runs": len(r), "speedup_vs_adjacent_mean": float(np.mean(r)), "speedup_vs_adjacent_min": min(r),
          "speedup_vs_adjacent_max": max(r)
      } for system, r in ratios.items() if len(r) > 1
  }


def write_json(results: dict, path: str) -> None:
  """Fills in what `derive` computes, then writes `results` to `path` (`harness.write_results`)."""
  derive(results)
  harness.write_results(results, path)


def _summary(row: dict) -> str:
  """One run's numbers for the log."""
  text = f"{row['tokens_per_second']:.2f} tok/s, compile {row['compile_time_s']:.1f} s"
  if row.get("profile"):
    text += (f", a round {1e3 * row['profile']['round_s']:.1f} ms = "
             f"{row['profile']['round_over_passes']:.2f}x its passes")
  if row["system"] != AUTOREGRESSIVE:
    text += (f", alpha_hat {number(row['alpha_hat'], '.3f')}, speedup {number(row['speedup_vs_autoregressive'])} "
             f"(modelled {number(row['modelled_speedup'])})")
    if row["temperature"] == 0:
      text += f", greedy = AR {row['outputs_match_autoregressive']}"
  return text


def run_specjax(cfg: ml_collections.ConfigDict, groups: list[Group], results: dict, save: Callable[[], None],
                log: Log) -> tuple[list[list[int]], list[int]]:
  """Loads the models, measures the costs and runs every group; returns the input ids of the
  transformers set's greedy prompts and the stop ids, for `run_transformers` (the models are released
  when this returns)."""
  loading = {}  # alias ("" = `draft`) -> a system that loads that draft model
  for group in groups:
    for system in group.systems:
      if decode_spec.from_config(group.decode_config(cfg, system)).loads_draft_model:
        loading.setdefault(system.draft, (group, system))
  group, system = loading.pop("", (groups[0], System(AUTOREGRESSIVE)))
  target, draft = pipeline.load_models(group.decode_config(cfg, system), log)
  drafts = {"": draft} | {
      alias: pipeline.load_models(group.decode_config(cfg, system), log, target=target)[1]
      for alias, (group, system) in loading.items()
  }
  results["costs"] = measure_costs(cfg, groups, target, drafts, log)
  save()
  total = sum(len(run_order(g, cfg.ar_every, cfg.repeats)) for g in groups)
  number = 0
  for group in groups:
    # Every compiled program of the 1.5B target holds ~1 GB of code and buffers: keeping all of them
    # (30+ programs) ran this 24 GB machine out of memory in the middle of a compile.
    jax.clear_caches()
    log(f"== {group.key}: batch {group.batch_size}, temperature {group.temperature:g}, "
        f"{len(group.prompts)} prompts: {', '.join(s.name for s in group.systems)}")
    for system in run_order(group, cfg.ar_every, cfg.repeats):
      number += 1
      result = pipeline.run(group.decode_config(cfg, system), log=lambda m: log(f"  {m}"),
                            models=(target, drafts[system.draft]))
      row = make_row(cfg, group, system, result, results["costs"])
      results["runs"].append(row)
      save()
      log(f"[{number}/{total}] {group.key} {system.name}: {_summary(row)}")
  reference = next((g for g in groups if g.prompt_set == cfg.transformers_set), groups[0])
  prompt_ids = prompts.encode(target.tokenizer, reference.prompts[:cfg.sets[reference.prompt_set].num_prompts],
                              reference.chat)
  return prompt_ids, list(target.tokenizer.eos_ids)


# -------------------------------------------------------------------------------------------- transformers


def run_transformers(cfg: ml_collections.ConfigDict, prompt_ids: list[list[int]], eos_ids: list[int], results: dict,
                     save: Callable[[], None], log: Log) -> None:
  """Plain `generate`, prompt lookup and (with a draft) assisted generation, K = default_k drafted
  tokens a round, on the transformers set's greedy prompts in `cfg.dtype`, batch 1 (transformers'
  prompt lookup and assisted generation take one row), each after a 2-token warm-up call."""
  start = time.perf_counter()
  model = hf_reference.hf_model(cfg.target, cfg.dtype)
  log(f"transformers loaded the target in {time.perf_counter() - start:.0f} s")
  lookup = {"prompt_lookup_num_tokens": int(cfg.ngram_k), "max_matching_ngram_size": int(cfg.drafters.ngram.max)}
  systems = [("transformers_generate", "transformers generate", {}),
             ("transformers_prompt_lookup", f"transformers prompt lookup K={cfg.ngram_k} (n<={cfg.drafters.ngram.max})",
              lookup)]
  if cfg.draft:
    assisted = {
        "assistant_model": hf_reference.hf_model(cfg.draft, cfg.dtype), "num_assistant_tokens": int(cfg.default_k),
        "num_assistant_tokens_schedule": "constant"
    }
    systems.append(("transformers_assisted", f"transformers assisted generation K={cfg.default_k}", assisted))
  for system, label, kwargs in systems:
    hf_reference.generate(model, [prompt_ids[0]], eos_ids, 2, **kwargs)  # warm-up
    outputs = [hf_reference.generate(model, [ids], eos_ids, cfg.max_new_tokens, **kwargs) for ids in prompt_ids]
    tokens, seconds = sum(len(rows[0]) for rows, _ in outputs), sum(s for _, s in outputs)
    results["transformers"].append({
        "group": f"{cfg.transformers_set}/greedy", "prompt_set": cfg.transformers_set, "regime": "greedy",
        "batch_size": 1, "temperature": 0.0, "system": system, "label": label, "dtype": cfg.dtype,
        "generate_kwargs": {k: v for k, v in kwargs.items() if k != "assistant_model"}, "generated_tokens": tokens,
        "wall_time_s": seconds, "tokens_per_second": tokens / seconds, "token_ids": [rows[0] for rows, _ in outputs]
    })
    save()
    row = results["transformers"][-1]
    log(f"{label}: {row['tokens_per_second']:.2f} tok/s, greedy = specjax AR {row['outputs_match_autoregressive']}")


# ------------------------------------------------------------------------------------------------ tables


def tables(results: dict) -> str:
  """The results as markdown: one table per (prompt set, regime) group, systems as rows."""
  derive(results)
  lines = harness.provenance(results)
  cost = results.get("costs")
  if cost:
    for batch, verify in cost["verify_cost"].items():
      lines.append(f"Batch {batch}: target step {cost['target_forward_s'][batch]['1'] * 1e3:.1f} ms; verify cost "
                   f"(K+1 tokens / 1) " + ", ".join(f"K={k}: {v:.2f}" for k, v in verify.items()) + "; c " +
                   ", ".join(f"{d}: {c:.3f}" for d, c in cost["cost_ratio_c"][batch].items()) + ".")
  header = ("| system | tokens/s | speedup vs AR | α̂ | mean accepted length | c | modelled speedup | compile s "
            "| greedy = AR |")
  rows_by_group: dict[str, list[dict]] = {}
  for row in results["runs"] + results.get("transformers", []):
    rows_by_group.setdefault(row["group"], []).append(row)
  for key, rows in rows_by_group.items():
    group = results["groups"].get(key, {})
    first = rows[0]
    prompt_tokens = next((r["prompt_tokens"] for r in rows if "prompt_tokens" in r), [])
    lines += [
        "", f"#### {first['prompt_set']}, {first['regime']}: batch "
        f"{first['batch_size']}, temperature {first['temperature']:g}, {len(prompt_tokens)} "
        f"prompt{'' if len(prompt_tokens) == 1 else 's'} of "
        f"{number(np.mean(prompt_tokens) if prompt_tokens else None, '.0f')} tokens on average", "", header,
        "|" + "---|" * 9
    ]
    speeds = group.get("autoregressive_runs") or []
    if speeds:
      lines.append(f"| specjax autoregressive | {group['autoregressive_tokens_per_second']:.2f} (mean of "
                   f"{len(speeds)}: {', '.join(f'{s:.2f}' for s in speeds)}) | 1.00 | | | | | "
                   f"{number(group['autoregressive_compile_time_s'], '.1f')} | |")
    for row in rows:
      if row["system"] == AUTOREGRESSIVE:
        continue
      match = row.get("outputs_match_autoregressive")
      cells = [
          row["label"], f"{row['tokens_per_second']:.2f}",
          number(row.get("speedup_vs_autoregressive")),
          number(row.get("alpha_hat"), ".3f"),
          number(row.get("mean_accepted_length")),
          number(row.get("cost_ratio_c"), ".3f"),
          number(row.get("modelled_speedup")),
          number(row.get("compile_time_s"), ".1f"), "" if match is None else "yes" if match else "NO"
      ]
      lines.append("| " + " | ".join(cells) + " |")
    for row in rows:
      policy = row.get("k_policy") or {}
      if policy.get("kind") == "adaptive":
        lines += [
            "", f"{row['label']}: rounds per proposal length " +
            ", ".join(f"{n}: {r}" for n, r in zip(k_policy.labels(policy), policy["rounds_per_length"])) +
            "; measured round cost " +
            ", ".join(f"{n}: {1e3 * c:.0f} ms" for n, c in zip(k_policy.labels(policy), policy["cost_table_s"])) +
            f" ({k_policy.tuning.cost_table_source(policy)})" + f"; policy step {1e6 * row['policy_step_s']:.1f} µs "
            f"= {100 * row['policy_share_of_cheapest_round']:.2g}% of the cheapest round."
        ]
    for system, summary in group.get("repeated", {}).items():
      lines += [
          "", f"{system}, {summary['runs']} runs: speedup over the adjacent autoregressive runs "
          f"{summary['speedup_vs_adjacent_mean']:.3f} on average ({summary['speedup_vs_adjacent_min']:.3f}"
          f"-{summary['speedup_vs_adjacent_max']:.3f})."
      ]
    by_system = {r["system"]: r for r in rows}
    lookup, plain = by_system.get("transformers_prompt_lookup"), by_system.get("transformers_generate")
    ngram = [r for r in rows if r.get("drafter") == "ngram"]
    if lookup and plain:
      lines += [
          "", f"transformers prompt lookup / transformers generate: "
          f"{lookup['tokens_per_second'] / plain['tokens_per_second']:.2f}x" +
          "".join(f"; specjax {r['label']} / transformers prompt lookup: "
                  f"{r['tokens_per_second'] / lookup['tokens_per_second']:.2f}x" for r in ngram) + "."
      ]
  mismatches = [
      f"{r['group']} {r['system']}" for r in results["runs"] + results.get("transformers", [])
      if r.get("outputs_match_autoregressive") is False
  ]
  lines += ["", "Greedy outputs that differ from specjax autoregressive: " + (", ".join(mismatches) or "none") + "."]
  return "\n".join(lines)


# -------------------------------------------------------------------------------------------------- main


def run(cfg: ml_collections.ConfigDict, log: Log = print) -> dict:
  """Runs the benchmark of `cfg`; returns the results, also written to `cfg.output`."""
  groups = plan(cfg, log)
  records.check_output(cfg.output)
  config = cfg.to_dict()
  config.update({field: records.relative(cfg[field]) for field in ("target", "draft", "output")})
  config["other_drafts"] = {alias: records.relative(name) for alias, name in cfg.other_drafts.items()}
  results = {
      "command": records.command(), "environment": records.environment(), "config": config,
      "prompts": {g.key: list(g.prompts) for g in groups}, "runs": [], "transformers": []
  }
  save = lambda: write_json(results, cfg.output)
  save()
  runs = sum(len(run_order(g, cfg.ar_every, cfg.repeats)) for g in groups)
  log(f"{len(groups)} groups, {runs} specjax runs" + (", then transformers" if cfg.transformers else ""))
  prompt_ids, eos_ids = run_specjax(cfg, groups, results, save, log)
  if cfg.transformers:
    gc.collect()  # the specjax models are unreferenced now; their memory goes before transformers loads
    jax.clear_caches()
    import torch

    results["environment"]["torch"] = torch.__version__
    run_transformers(cfg, prompt_ids, eos_ids, results, save, log)
  log(f"wrote {cfg.output}")
  return results


def main(cfg: ml_collections.ConfigDict) -> None:
  harness.report_or_run(cfg, run, tables)


if __name__ == "__main__":
  harness.run_script(main, "Benchmark config (configs/benchmarks/drafters.py).")
