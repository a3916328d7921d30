"""MT-Bench, the benchmark the speculative-decoding papers report: every system on both turns of its
questions, per category and overall, in one run, one JSON file, markdown tables and a figure.

  python -m specjax.data fetch mt-bench                  # once: the 80 questions, sha256-checked
  python -m experiments.mtbench --config=configs/benchmarks/mtbench.py [--config.FIELD=...]
  python -m experiments.mtbench --config=configs/benchmarks/mtbench.py \
      --config.report=experiments/results/mtbench_qwen_cpu.json        # the tables (and figure) of a file

The questions: the first `questions_per_category` of each of `categories` (all 8 by default), both
turns; turn 2 is decoded from the chat template of turn 1, the system's own turn-1 answer and the second
user message (`specjax.prompts`), as FastChat and EAGLE build it, so prompt lookup meets text that
repeats the first answer.

Groups: every (batch size, temperature) of `batch_sizes` x `temperatures`; at batch 1 the systems of
`systems`, above it those of `batched_systems` (names as in configs/benchmarks/drafters.py: "model_k5",
"model_k8_adaptive", "ngram", "layer_skip", "eagle_k4", ...). Each group runs specjax autoregressive
decoding first, after every `ar_every` systems and last, and divides each system's tokens/s by the mean
of those runs (`benchmark_drafters.derive`). Per category (batch 1, where each batch is one question):
tokens/s over the category's questions and turns, its speedup over the autoregressive runs' same
category, τ (mean tokens per target pass) and α̂. Greedy outputs are compared with autoregressive
decoding token for token (recorded, never asserted). Compile time is apart from throughput; tokens/s
includes each turn's prefill.

`transformers` (after the specjax runs, with specjax's models released), batch 1, each question's turns
built from its own answers: plain `generate`, assisted generation with the draft model (its default
schedule) and prompt lookup (`prompt_lookup_num_tokens` = ngram_k, `max_matching_ngram_size` =
drafters.ngram.max), at `transformers_temperatures`, each after a 2-token warm-up call.

The JSON (`output`) is rewritten after every run. Started again, the script keeps what the file holds
and runs only what is missing: a killed run resumes (the autoregressive runs it already made still count
as that group's baseline), and a grid grown by a temperature, a batch size or a system (`SELECTION_FIELDS`)
adds only the new runs. A file measured otherwise (another model, budget, question set...) is replaced.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
from typing import Callable

import jax
import ml_collections
import numpy as np

from experiments import benchmark_drafters, harness, hf_reference
from experiments.benchmark_drafters import AUTOREGRESSIVE, System
from experiments.harness import number
from specjax import decode_spec, pipeline, prompts, records, session
from specjax.data import mtbench
from specjax.errors import ConfigError
from specjax.models.tokenizer import Tokenizer

Log = Callable[[str], None]
TRANSFORMERS = ("generate", "assisted", "prompt_lookup")

# The stats of a whole call each row records.
CALL_STATS = ("tokens_per_second", "wall_time_s", "compile_time_s", "generated_tokens", "target_calls", "alpha_hat",
              "mean_accepted_length")


def source(cfg: ml_collections.ConfigDict) -> str:
  """The `config.prompts_file` of the benchmark's questions: the MT-Bench selection, or a file's."""
  if cfg.questions != prompts.MT_BENCH:
    return cfg.questions
  category = f"category={','.join(cfg.categories)}&" if cfg.categories else ""
  return f"{prompts.MT_BENCH}?{category}per_category={cfg.questions_per_category}"


@dataclasses.dataclass(frozen=True)
class Group:
  """The runs at one batch size and temperature: one baseline, many systems."""

  batch_size: int
  temperature: float
  systems: tuple[System, ...]

  @property
  def key(self) -> str:
    return f"batch{self.batch_size}/T{self.temperature:g}"

  def decode_config(self, cfg: ml_collections.ConfigDict, system: System) -> ml_collections.ConfigDict:
    return benchmark_drafters.decode_config(cfg, system, prompts_file=source(cfg), chat=True,
                                            batch_size=self.batch_size, temperature=self.temperature)


def plan(cfg: ml_collections.ConfigDict) -> list[Group]:
  """Every group, each system's decode config validated: a bad value fails here, before any model loads."""
  def require(ok: bool, message: str) -> None:
    if not ok:
      raise ConfigError(message)

  require(cfg.questions_per_category >= 1, f"config.questions_per_category must be >= 1, got "
          f"{cfg.questions_per_category}")
  error = mtbench.selection_error(tuple(cfg.categories), cfg.questions_per_category)
  require(error is None, f"config.categories: {error}")
  require(
      bool(cfg.batch_sizes) and all(int(b) == b and b >= 1 for b in cfg.batch_sizes),
      f"config.batch_sizes must be integers >= 1, got {cfg.batch_sizes}")
  require(
      bool(cfg.temperatures) and all(t >= 0 for t in cfg.temperatures),
      f"config.temperatures must be >= 0, got {cfg.temperatures}")
  require(
      int(cfg.ar_every) == cfg.ar_every and cfg.ar_every >= 1, f"config.ar_every must be an integer >= 1, "
      f"got {cfg.ar_every}")
  unknown = [t for t in cfg.transformers if t not in TRANSFORMERS]
  require(
      not unknown, f"config.transformers: unknown system {unknown[0] if unknown else ''!r}; known: "
      f"{', '.join(TRANSFORMERS)}")
  require(not ("assisted" in cfg.transformers and not cfg.draft), "config.transformers has 'assisted' but "
          "config.draft is empty (the assistant model)")
  require(
      all(t in cfg.temperatures for t in cfg.transformers_temperatures) or not cfg.transformers,
      f"config.transformers_temperatures {cfg.transformers_temperatures} must be among config.temperatures "
      f"(their speedups divide by the batch-1 autoregressive runs)")
  require(not cfg.transformers or 1 in cfg.batch_sizes, "config.transformers runs at batch 1: add 1 to "
          "config.batch_sizes")
  groups = []
  for batch_size in cfg.batch_sizes:
    field = "systems" if batch_size == 1 else "batched_systems"
    systems = tuple(benchmark_drafters.parse_systems(cfg[field], cfg, f"config.{field}"))
    for temperature in cfg.temperatures:
      group = Group(int(batch_size), float(temperature), systems)
      for system in (System(AUTOREGRESSIVE), *systems):
        try:
          decode_spec.from_config(group.decode_config(cfg, system))
        except ConfigError as e:
          raise ConfigError(f"config.{field}, system {system.name}: {e}") from None
      groups.append(group)
  return groups


# ------------------------------------------------------------------------------------------------ runs


def by_category(outputs: list[dict], per_question_time: bool) -> dict[str, dict]:
  """Per category of `outputs`: tokens, τ and α̂ (speculative), and tokens/s when each batch held one
  question (`per_question_time`: batch 1; larger batches mix categories)."""
  categories: dict[str, dict] = {}
  for o in outputs:
    c = categories.setdefault(o["category"],
                              {"generated_tokens": 0, "wall_time_s": 0.0, "rounds": 0, "accepted": 0, "rejections": 0})
    c["generated_tokens"] += o["num_tokens"]
    c["wall_time_s"] += o["batch_wall_time_s"]
    if "stats" in o:
      for field in ("rounds", "accepted", "rejections"):
        c[field] += o["stats"][field]
  for c in categories.values():
    c["tokens_per_second"] = c["generated_tokens"] / c["wall_time_s"] if per_question_time else None
    c["tau"] = (c["accepted"] + c["rounds"]) / c["rounds"] if c["rounds"] else None
    attempts = c["accepted"] + c["rejections"]
    c["alpha_hat"] = c["accepted"] / attempts if attempts else None
  return categories


def make_row(cfg: ml_collections.ConfigDict, group: Group, index: int, system: System, result: dict) -> dict:
  """One run's record: its group, place in the run order, system, statistics overall, per turn and per
  category, and its outputs' token ids (texts too for the baseline)."""
  stats, outputs = result["stats"], result["outputs"]
  row = {
      "group": group.key, "index": index, "batch_size": group.batch_size, "temperature": group.temperature,
      "system": system.name, "label": system.label(cfg), "drafter": system.drafter if system.speculative else None,
      "k": system.k if system.speculative else None, "k_policy": stats.get("k_policy"),
      **{f: stats.get(f) for f in CALL_STATS}, "turns": [
          {f: t.get(f)
           for f in ("turn", "tokens_per_second", "generated_tokens", "alpha_hat", "mean_accepted_length")}
          for t in stats["turns"]
      ], "categories": by_category(outputs, group.batch_size == 1), "question_ids": [o["question_id"] for o in outputs],
      "turn_of_output": [o["turn"] for o in outputs], "token_ids": [o["token_ids"] for o in outputs]
  }
  if not system.speculative:
    row["texts"] = [o["text"] for o in outputs]
  return row


def derive(results: dict) -> None:
  """`benchmark_drafters.derive` (baselines, speedups, greedy comparisons), then per category each run's
  speedup over the mean of its group's autoregressive runs in that category."""
  benchmark_drafters.derive(results)
  baseline: dict[str, dict[str, float]] = {}
  for key in results["groups"]:
    runs = [r for r in results["runs"] if r["group"] == key and r["system"] == AUTOREGRESSIVE]
    speeds = {
        c: [r["categories"][c]["tokens_per_second"] for r in runs] for c in (runs[0]["categories"] if runs else {})
    }
    baseline[key] = {c: float(np.mean(s)) for c, s in speeds.items() if None not in s}
    results["groups"][key]["autoregressive_category_tokens_per_second"] = baseline[key]
  for row in results["runs"] + results["transformers"]:
    for category, c in row["categories"].items():
      reference = baseline.get(row["group"], {}).get(category)
      c["speedup_vs_autoregressive"] = (c["tokens_per_second"] /
                                        reference if reference and c["tokens_per_second"] is not None else None)


def write_json(results: dict, path: str) -> None:
  derive(results)
  harness.write_results(results, path)


def planned_runs(groups: list[Group], ar_every: int) -> list[tuple[Group, int, System]]:
  """(group, place in its run order, system) of every specjax run of the plan."""
  return [(g, i, s) for g in groups for i, s in enumerate(benchmark_drafters.run_order(g, ar_every))]


def transformers_runs(cfg: ml_collections.ConfigDict) -> list[tuple[float, str]]:
  """(temperature, name) of every transformers run the config asks for."""
  return [(float(t), name) for t in cfg.transformers_temperatures for name in cfg.transformers]


def run_specjax(cfg: ml_collections.ConfigDict, groups: list[Group], results: dict, save: Callable[[], None],
                log: Log) -> Tokenizer:
  """Loads the models once and makes every run the results lack; returns the target's tokenizer (the
  models are released when this returns)."""
  done = {(r["group"], r["index"]) for r in results["runs"]}
  todo = [(g, i, s) for g, i, s in planned_runs(groups, cfg.ar_every) if (g.key, i) not in done]
  group, system = next(
      (
          (g, s)
          for g in groups
          for s in g.systems  # one that loads a draft model, if any
          if decode_spec.from_config(g.decode_config(cfg, s)).loads_draft_model),
      (groups[0], System(AUTOREGRESSIVE)))
  target, draft = pipeline.load_models(group.decode_config(cfg, system), log)
  log(f"{len(todo)} specjax runs to make ({len(done)} already in {cfg.output})")
  current, sessions = None, None
  for number_, (group, index, system) in enumerate(todo, 1):
    if group.key != current:
      # Every compiled program of the 1.5B target holds ~1 GB of code and buffers: drop a group's
      # programs before the next group compiles its own.
      jax.clear_caches()
      # A group's runs share their sessions (the adaptive policy's cost table is measured once per program).
      current, sessions = group.key, session.Sessions((target, draft), log=lambda m: log(f"  {m}"))
      log(f"== {group.key}: {', '.join(s.name for s in group.systems)}")
    result = pipeline.run(group.decode_config(cfg, system), log=lambda m: log(f"  {m}"), sessions=sessions)
    results["runs"].append(make_row(cfg, group, index, system, result))
    save()
    row = results["runs"][-1]  # with its speedup and greedy comparison, which `save` derived
    log(f"[{number_}/{len(todo)}] {group.key} {system.name}: {row['tokens_per_second']:.2f} tok/s, tau "
        f"{number(row['mean_accepted_length'])}, speedup {number(row.get('speedup_vs_autoregressive'))}, "
        f"greedy = AR {row.get('outputs_match_autoregressive')}")
  return target.tokenizer


def run_transformers(cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, results: dict, save: Callable[[], None],
                     log: Log) -> None:
  """The transformers systems the results lack, batch 1, each conversation's turns from its own answers."""
  done = {(r["system"], r["temperature"]) for r in results["transformers"]}
  todo = [(t, name) for t, name in transformers_runs(cfg) if (f"transformers_{name}", t) not in done]
  if not todo:
    return
  model = hf_reference.hf_model(cfg.target)
  assistant = hf_reference.hf_model(cfg.draft) if any(name == "assisted" for _, name in todo) else None
  conversations = prompts.requests((), source(cfg))
  eos = list(tokenizer.eos_ids)
  options = {
      "generate": {}, "assisted": {"assistant_model": assistant}, "prompt_lookup": {
          "prompt_lookup_num_tokens": int(cfg.ngram_k), "max_matching_ngram_size": int(cfg.drafters.ngram.max)
      }
  }
  for temperature, name in todo:
    kwargs = options[name]
    first = prompts.turn_ids(tokenizer, conversations[0], (), True)
    hf_reference.generate(model, [first], eos, 2, temperature, cfg.seed, **kwargs)  # warm-up
    outputs = []
    for i, conversation in enumerate(conversations):
      answers: list[str] = []
      for turn in range(len(conversation.turns)):
        ids = prompts.turn_ids(tokenizer, conversation, answers, True)
        rows, seconds = hf_reference.generate(model, [ids], eos, cfg.max_new_tokens, temperature, cfg.seed + i,
                                              **kwargs)
        answers.append(prompts.answer_text(tokenizer, rows[0]))
        outputs.append({
            "category": conversation.meta["category"], "question_id": conversation.meta["question_id"],
            "turn": turn + 1, "token_ids": rows[0], "num_tokens": len(rows[0]), "batch_wall_time_s": seconds
        })
    tokens, seconds = sum(o["num_tokens"] for o in outputs), sum(o["batch_wall_time_s"] for o in outputs)
    turns = [[o for o in outputs if o["turn"] == t] for t in (1, 2)]
    results["transformers"].append({
        "group": Group(1, float(temperature), ()).key, "batch_size": 1, "temperature": float(temperature),
        "system": f"transformers_{name}", "label": f"transformers {name.replace('_', ' ')}", "generated_tokens": tokens,
        "wall_time_s": seconds, "tokens_per_second": tokens / seconds, "turns": [{
            "turn": t + 1, "generated_tokens": sum(o["num_tokens"] for o in rows),
            "tokens_per_second": sum(o["num_tokens"] for o in rows) / sum(o["batch_wall_time_s"] for o in rows)
        } for t, rows in enumerate(turns) if rows], "categories": by_category(outputs, True),
        "question_ids": [o["question_id"] for o in outputs], "turn_of_output": [o["turn"] for o in outputs],
        "token_ids": [o["token_ids"] for o in outputs]
    })
    save()
    row = results["transformers"][-1]
    log(f"transformers {name} T={temperature:g}: {row['tokens_per_second']:.2f} tok/s, speedup "
        f"{number(row.get('speedup_vs_autoregressive'))}, greedy = specjax AR "
        f"{row.get('outputs_match_autoregressive')}")


# ------------------------------------------------------------------------------------------------ tables


def _rows(results: dict, key: str) -> list[dict]:
  return [r for r in results["runs"] + results["transformers"] if r["group"] == key and r["system"] != AUTOREGRESSIVE]


def tables(results: dict) -> str:
  """The results as markdown: per group, the systems overall and per turn; at batch 1, per category."""
  derive(results)
  lines = harness.provenance(results)
  lines[-1] += "  "
  lines.append(f"Questions: `{results['source']}`, {results['config']['max_new_tokens']} new tokens per turn at most.")
  for key, group in results["groups"].items():
    rows = _rows(results, key)
    speeds = group["autoregressive_runs"]
    lines += [
        "", f"#### {key.replace('/', ', ').replace('batch', 'batch ').replace('T', 'temperature ')}", "",
        "| system | tokens/s | speedup vs AR | turn 1 | turn 2 | τ | α̂ | compile s | greedy = AR |", "|" + "---|" * 9
    ]
    if speeds:
      lines.append(f"| specjax autoregressive | {group['autoregressive_tokens_per_second']:.2f} (mean of "
                   f"{len(speeds)}: {', '.join(f'{s:.2f}' for s in speeds)}) | 1.00 | | | | | "
                   f"{number(group['autoregressive_compile_time_s'], '.1f')} | |")
    ar_turns = _ar_turn_speeds(results, key)
    for row in rows:
      turn_speedups = [
          number(t["tokens_per_second"] / ar_turns[t["turn"]] if ar_turns.get(t["turn"]) else None)
          for t in row["turns"]
      ]
      match = row.get("outputs_match_autoregressive")
      lines.append("| " + " | ".join([
          row["label"], f"{row['tokens_per_second']:.2f}",
          number(row.get("speedup_vs_autoregressive")), *(turn_speedups + ["n/a"] * (2 - len(turn_speedups))),
          number(row.get("mean_accepted_length")),
          number(row.get("alpha_hat"), ".3f"),
          number(row.get("compile_time_s"), ".1f"), "" if match is None else "yes" if match else "NO"
      ]) + " |")
    baseline = group.get("autoregressive_category_tokens_per_second") or {}
    if baseline and rows:
      lines += [
          "", f"Per category ({key}): speedup vs AR (τ); AR tokens/s in the second column.", "",
          "| category | AR tokens/s | " + " | ".join(r["label"] for r in rows) + " | best |",
          "|" + "---|" * (len(rows) + 3)
      ]
      for category in baseline:
        cells = [(r["categories"].get(category,
                                      {}).get("speedup_vs_autoregressive"), r["categories"].get(category,
                                                                                                {}).get("tau"))
                 for r in rows]
        best = max(range(len(rows)), key=lambda i: cells[i][0] or 0.0)
        lines.append(f"| {category} | {baseline[category]:.2f} | " +
                     " | ".join(f"{number(s)} ({number(t)})" if t is not None else number(s) for s, t in cells) +
                     f" | {rows[best]['label']} ({number(cells[best][0])}x) |")
  mismatches = [
      f"{r['group']} {r['system']}" for r in results["runs"] + results["transformers"]
      if r.get("outputs_match_autoregressive") is False
  ]
  lines += ["", "Greedy outputs that differ from specjax autoregressive: " + (", ".join(mismatches) or "none") + "."]
  return "\n".join(lines)


def _ar_turn_speeds(results: dict, key: str) -> dict[int, float]:
  """turn -> mean tokens/s of the group's autoregressive runs in that turn."""
  runs = [r for r in results["runs"] if r["group"] == key and r["system"] == AUTOREGRESSIVE]
  return {
      t["turn"]: float(np.mean([r["turns"][i]["tokens_per_second"] for r in runs]))
      for i, t in enumerate(runs[0]["turns"])
  } if runs else {}


def figure(results: dict, path: str) -> str:
  """Speedup over autoregressive decoding and τ per category, one bar per system, for each batch-1 group."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  derive(results)
  keys = [k for k, g in results["groups"].items() if g.get("autoregressive_category_tokens_per_second")]
  fig, axes = plt.subplots(len(keys), 2, figsize=(14, 3.6 * len(keys)), squeeze=False)
  for (speed_ax, tau_ax), key in zip(axes, keys):
    rows = _rows(results, key)
    categories = list(results["groups"][key]["autoregressive_category_tokens_per_second"])
    width = 0.8 / max(len(rows), 1)
    for i, row in enumerate(rows):
      x = np.arange(len(categories)) + (i - (len(rows) - 1) / 2) * width
      speed = [row["categories"].get(c, {}).get("speedup_vs_autoregressive") or 0.0 for c in categories]
      tau = [row["categories"].get(c, {}).get("tau") or 0.0 for c in categories]
      speed_ax.bar(x, speed, width, label=row["label"])
      tau_ax.bar(x, tau, width, label=row["label"])
    speed_ax.axhline(1.0, color="black", linewidth=0.8)
    for ax, title in ((speed_ax, f"speedup vs specjax autoregressive, {key}"), (tau_ax,
                                                                                f"τ (tokens per target pass), {key}")):
      ax.set_xticks(np.arange(len(categories)), categories, rotation=20)
      ax.set_title(title, fontsize=10)
    speed_ax.legend(fontsize=7)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


# -------------------------------------------------------------------------------------------------- main


def _config_record(cfg: ml_collections.ConfigDict) -> dict:
  """The config as the results file holds it (paths from the repository root, JSON types: a resumed run
  compares it with the file's)."""
  config = cfg.to_dict()
  config.update({field: records.relative(cfg[field]) for field in ("target", "draft", "questions", "output", "figure")})
  config.pop("report")
  return json.loads(json.dumps(config))


# Fields that only choose which runs are made: a results file whose config differs in these alone keeps
# the runs the new plan still holds (a grid grown by a temperature or a system resumes).
SELECTION_FIELDS = ("temperatures", "batch_sizes", "systems", "batched_systems", "transformers",
                    "transformers_temperatures", "ar_every", "figure")


def reusable(earlier: dict, config: dict, groups: list[Group], cfg: ml_collections.ConfigDict) -> dict | None:
  """The runs of an earlier results file that the plan `groups` still holds (same group, place in the
  run order and system; transformers systems still asked for), or None when the earlier file was
  measured otherwise (its config differs in a field that changes what a run measures)."""
  strip = lambda c: {k: v for k, v in c.items() if k not in SELECTION_FIELDS}
  if strip(earlier.get("config", {})) != strip(config):
    return None
  order = {(g.key, i): s.name for g, i, s in planned_runs(groups, cfg.ar_every)}
  wanted = {(f"transformers_{name}", t) for t, name in transformers_runs(cfg)}
  return {
      "runs": [r for r in earlier["runs"] if order.get((r["group"], r["index"])) == r["system"]],
      "transformers": [r for r in earlier["transformers"] if (r["system"], r["temperature"]) in wanted]
  }


def run(cfg: ml_collections.ConfigDict, log: Log = print) -> dict:
  """Runs what the results file `cfg.output` lacks; returns the results (also written there)."""
  groups = plan(cfg)
  records.check_output(cfg.output)
  prompts.requests((), source(cfg))  # the questions are there (fetched) before any model loads
  config = _config_record(cfg)
  results = {
      "command": records.command(), "environment": records.environment(), "config": config, "source": source(cfg),
      "runs": [], "transformers": []
  }
  if os.path.exists(cfg.output):
    kept = reusable(harness.read_results(cfg.output, "output"), config, groups, cfg)
    if kept is None:
      log(f"{cfg.output} holds results measured otherwise (another model, budget or question set): starting afresh")
    else:
      results.update(kept)
      log(f"resuming {cfg.output}: {len(results['runs'])} specjax and {len(results['transformers'])} transformers "
          f"runs kept")
  save = lambda: write_json(results, cfg.output)
  save()
  tokenizer = run_specjax(cfg, groups, results, save, log)
  if cfg.transformers:
    gc.collect()  # the specjax models are unreferenced now; their memory goes before transformers loads
    jax.clear_caches()
    import torch

    results["environment"]["torch"] = torch.__version__
    run_transformers(cfg, tokenizer, results, save, log)
  save()
  if cfg.figure:
    log(f"wrote {figure(results, cfg.figure)}")
  log(f"wrote {cfg.output}")
  return results


def main(cfg: ml_collections.ConfigDict) -> None:
  if cfg.report and cfg.figure:
    figure(harness.read_results(cfg.report), cfg.figure)
  harness.report_or_run(cfg, run, tables)


if __name__ == "__main__":
  harness.run_script(main, "MT-Bench config (configs/benchmarks/mtbench.py).")
