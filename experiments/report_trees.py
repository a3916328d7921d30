"""Trees against chains: reads tree sweep tables (`configs/sweeps/qwen_coder_trees*.py`), measures the
forward costs of the widths they used on this machine, and writes one JSON result with two cost models.

  python -m experiments.report_trees --config=configs/reports/trees.py
  python -m experiments.report_trees --config=configs/reports/trees.py:ngram   # the n-gram spines

Per speculative row: the shape (N draft nodes verified per round, depth D), accepted draft tokens per
round (tokens per round minus the target's own token), per-depth acceptance, draft passes per round,
measured tokens/s and speedup. Then two predictions of the speedup over autoregressive decoding, from
tokens per round and the passes each round costs:
- `predicted_cpu`: with this machine's measured seconds of a T-token forward (target: the N + 1
  verified tokens; draft: each level of a tree, one token per chain pass), checked against the
  measured speedup;
- `predicted_accelerator`: where a verify of up to 64 tokens costs one target step (memory-bound: the
  weights are read once whatever T) and every draft pass costs c target steps, c = the 1-token cost
  ratio measured here: tokens per round / (1 + c x draft passes per round);
- `predicted_measured_accelerator` (with `accelerator=RESULTS.json`, a results file of the accelerator
  run kit `experiments/benchmark_accelerator.py`): the same with that device's measured numbers instead
  of the premise: the verify of N + 1 tokens at its measured multiple of a step (interpolated linearly
  between the kit's `verify_widths`) and c as the kit measured it, at the kit's smallest batch size not
  below the row's (its first prompt length): tokens per round / (verify / step + c x draft passes); for
  the model drafter (the kit's pair) and lookups (c = 0) only.
Rows without a draft model (a lookup, an EAGLE head) cost each draft pass the 1-token c the sweep
measured for them (0 for a lookup).
The comparison of the issue: at temperature 1, the best tree's accepted draft tokens per round against
the chain whose K equals the tree's node count (or the longest chain measured, if none does).
"""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from experiments import harness
from experiments.sweep import read_table
from specjax import costs, pipeline, records
from specjax.speculative.trees.dynamic import DynamicSpec
from specjax.speculative.trees.tree import chain, parse


def shape(row: dict):
  """The row's static tree (a chain of K when it has none)."""
  return parse(row["tree"]) if row.get("tree") else chain(row["k"])


def draft_widths(row: dict) -> list[int]:
  """Tokens fed by each draft pass of one round: none for a lookup; a dynamic tree's root and its
  frontiers; a static tree's levels (and its leaves, for a draft model); a chain's 1s."""
  tree = shape(row)
  if row.get("drafter") == "ngram":
    return []
  if isinstance(tree, DynamicSpec):
    return [1] + [tree.expand] * (tree.depth - 1)
  if row.get("tree"):
    levels = tree.max_depth + (1 if row.get("drafter", "model") == "model" else 0)
    return [tree.depth.count(d) for d in range(levels)]
  return [1] * max(1, round(row["draft_calls"] / max(1, row["target_calls"] - 1)))


def label(row: dict) -> str:
  """"chain K=k", "tree (4, 1, 1, 1)", or for a long path list its size ("paths N=16 D=10")."""
  if not row.get("tree"):
    return f"chain K={row['k']}"
  if len(row["tree"]) <= 24:
    return f"tree {row['tree']}"
  tree = shape(row)
  return f"paths N={tree.nodes_with_root - 1} D={tree.max_depth}"


def summarize_row(row: dict) -> dict:
  tree = shape(row)
  rounds = max(1, row["target_calls"] - 1)
  return {
      "label": label(row), "drafter": row.get("drafter") or "model", "tree": row.get("tree") or "", "k": row["k"],
      "nodes": tree.nodes_with_root - 1, "depth": tree.max_depth, "temperature": row["temperature"],
      "batch_size": row["batch_size"], "tokens_per_round": row["mean_accepted_length"],
      "accepted_per_round": row["mean_accepted_length"] - 1.0, "per_depth_acceptance": row["per_position_acceptance"],
      "draft_passes_per_round": row["draft_calls"] / rounds, "draft_widths": draft_widths(row),
      "tokens_per_second": row["tokens_per_second"],
      "autoregressive_tokens_per_second": row["autoregressive_tokens_per_second"],
      "speedup": row["speedup_vs_autoregressive"], "cost_ratio_c": row["cost_ratio_c"]
  }


def measure_costs(rows: list[dict], config: dict, repeats: int) -> dict:
  """{batch: {"target": {T: s}, "draft": {T: s}}} for every width the rows verify or draft, with the
  models of the decode `config` (no draft seconds for a lookup drafter)."""
  target, draft = pipeline.load_models(ml_collections.ConfigDict(config), lambda message: None)
  out = {}
  for batch in sorted({r["batch_size"] for r in rows}):
    at = [r for r in rows if r["batch_size"] == batch]
    verify = sorted({1} | {r["nodes"] + 1 for r in at})
    drafted = sorted({1} | {w for r in at for w in r["draft_widths"]})
    out[batch] = {
        "target": costs.forward_seconds(target.config, target.params, verify, repeats, batch),
        "draft": {} if draft is None else  # a lookup (the n-gram drafter) runs no draft model
                 costs.forward_seconds(draft.config, draft.params, drafted, repeats, batch)
    }
  return out


def predict(row: dict, seconds: dict) -> None:
  """Adds both predicted speedups (module docstring) to a summarized row."""
  step = seconds["target"][1]
  if seconds["draft"]:  # a draft model: its measured passes of every width
    c = seconds["draft"][1] / step
    draft_s = sum(seconds["draft"][w] for w in row["draft_widths"])
  else:  # a lookup (c = 0) or an EAGLE head: its 1-token cost ratio measured by the sweep, per pass
    c = row["cost_ratio_c"] or 0.0
    draft_s = c * step * row["draft_passes_per_round"]
  row["predicted_cpu"] = row["tokens_per_round"] * step / (seconds["target"][row["nodes"] + 1] + draft_s)
  row["predicted_accelerator"] = row["tokens_per_round"] / (1.0 + c * row["draft_passes_per_round"])


def accelerator_costs(results: dict) -> dict:
  """{batch: (widths [T], verify seconds / step [T], c)} from a results file of the accelerator run kit."""
  cs = {(c["prompt_tokens"], c["batch_size"]): c["cost_ratio_c"] for c in results["costs"]}
  out = {}
  for v in results.get("verify_costs", []):
    widths = sorted(int(t) for t in v["in_target_steps"])
    out[v["batch_size"]] = (widths, [v["in_target_steps"][str(t)] for t in widths], cs[(v["prompt_tokens"],
                                                                                        v["batch_size"])])
  if not out:
    raise ValueError("the accelerator results hold no verify_costs (a kit run with config.verify_widths)")
  return out


def predict_measured_accelerator(row: dict, measured: dict) -> None:
  """Adds `predicted_measured_accelerator` (module docstring) to a model-drafter or lookup row when the kit
  measured a batch size at least the row's and verify widths up to its N + 1; None otherwise."""
  batches = [b for b in sorted(measured) if b >= row["batch_size"]]
  verified = row["nodes"] + 1
  prediction = None
  if batches and verified <= measured[batches[0]][0][-1] and row["drafter"] in ("model", "ngram"):
    widths, steps, c = measured[batches[0]]  # c: the kit's draft model's (a lookup costs none)
    c = c if row["drafter"] == "model" else 0.0
    verify_steps = float(np.interp(verified, widths, steps))
    prediction = row["tokens_per_round"] / (verify_steps + c * row["draft_passes_per_round"])
  row["predicted_measured_accelerator"] = prediction


def comparison(rows: list[dict], temperature: float, batch: int) -> dict | None:
  """The best tree of at most 16 nodes against the chain of as many verified tokens."""
  at = [r for r in rows if r["temperature"] == temperature and r["batch_size"] == batch]
  trees = [r for r in at if r["tree"] and r["nodes"] <= 16]
  chains = [r for r in at if not r["tree"]]
  if not trees or not chains:
    return None
  best = max(trees, key=lambda r: r["accepted_per_round"])
  same = [c for c in chains if c["nodes"] == best["nodes"]] or [max(chains, key=lambda c: c["nodes"])]
  return {
      "temperature": temperature, "batch_size": batch, "tree": best["label"], "chain": same[0]["label"],
      "same_verified_tokens": same[0]["nodes"] == best["nodes"], "tree_accepted_per_round": best["accepted_per_round"],
      "chain_accepted_per_round": same[0]["accepted_per_round"],
      "ratio": best["accepted_per_round"] / same[0]["accepted_per_round"],
      "best_chain_of_any_k": max(chains, key=lambda c: c["accepted_per_round"])["label"]
  }


def figure(rows: list[dict], batch: int, path: str) -> str:
  """Accepted draft tokens per round against tokens verified per round, greedy and at T = 1: chains as
  a line, static trees as dots, dynamic trees as stars (each labelled)."""
  from experiments import plots  # matplotlib, only when plotting

  temperatures = sorted({r["temperature"] for r in rows if r["batch_size"] == batch})
  fig, axes = plots.plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4.5), squeeze=False)
  for ax, temperature in zip(axes[0], temperatures):
    at = [r for r in rows if r["batch_size"] == batch and r["temperature"] == temperature]
    chains = sorted((r for r in at if not r["tree"]), key=lambda r: r["nodes"])
    ax.plot([r["nodes"] + 1 for r in chains], [r["accepted_per_round"] for r in chains], "-o", color="gray",
            label="chains (K = " + ", ".join(str(r["k"]) for r in chains) + ")")
    for r in at:
      if r["tree"]:
        dynamic = r["tree"].startswith("dynamic")
        ax.plot(r["nodes"] + 1, r["accepted_per_round"], "*" if dynamic else "o", markersize=11 if dynamic else 7)
        ax.annotate(r["label"].removeprefix("tree "), (r["nodes"] + 1, r["accepted_per_round"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set(xlabel="tokens verified per round (N + 1)", ylabel="accepted draft tokens per round",
           title=f"temperature {temperature:g}, batch {batch}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  return plots.save_figure(fig, os.path.dirname(path) or ".", os.path.basename(path))


def markdown(rows: list[dict]) -> str:
  fmt = lambda x, spec=".2f": harness.number(x, spec, missing="")
  measured = any("predicted_measured_accelerator" in r for r in rows)
  lines = [
      "| batch | T | drafter | N | D | accepted / round | draft passes | tok/s | speedup | predicted CPU "
      "| predicted accelerator |" + (" measured accelerator costs |" if measured else ""),
      "|" + "---|" * (11 + measured)
  ]
  for r in rows:
    lines.append(f"| {r['batch_size']} | {r['temperature']:g} | {r['label']} | {r['nodes']} | {r['depth']} | "
                 f"{r['accepted_per_round']:.2f} | {r['draft_passes_per_round']:.1f} | "
                 f"{r['tokens_per_second']:.2f} | {fmt(r['speedup'])} | {fmt(r.get('predicted_cpu'))} | "
                 f"{fmt(r.get('predicted_accelerator'))} |" +
                 (f" {fmt(r.get('predicted_measured_accelerator'))} |" if measured else ""))
  return "\n".join(lines)


def run(cfg: ml_collections.ConfigDict, log: harness.Log = print) -> dict:
  """Summarises the tables' speculative rows and predicts their speedups; returns the results, also
  written to `cfg.output`, with the markdown table (`log`ged), the figure and the comparisons."""
  raw = [r for path in cfg.tables for r in read_table(path) if r["mode"] == "speculative"]
  if not raw:
    raise ValueError(f"no speculative rows in {list(cfg.tables)}")
  rows = sorted((summarize_row(r) for r in raw), key=lambda r: (r["batch_size"], r["temperature"], r["nodes"]))
  if cfg.reuse_costs:  # re-render a result: the forward costs it measured
    seconds = {
        int(b): {m: {int(t): v for t, v in at.items()} for m, at in by_model.items()}
        for b, by_model in harness.read_results(cfg.output, "output")["forward_seconds"].items()
    }
  else:
    seconds = measure_costs(rows, raw[0]["config"], cfg.repeats)
  measured = accelerator_costs(harness.read_results(cfg.accelerator, "accelerator")) if cfg.accelerator else None
  for row in rows:
    predict(row, seconds[row["batch_size"]])
    if measured:
      predict_measured_accelerator(row, measured)
  result = {
      "rows": rows, "forward_seconds": seconds, "comparisons": [
          c for c in (comparison(rows, t, b) for t in (0.0, 1.0) for b in sorted({r["batch_size"] for r in rows})) if c
      ], "tables": list(cfg.tables), "accelerator": cfg.accelerator, "environment": records.environment(),
      "command": records.command()
  }
  harness.write_results(result, cfg.output)
  log(markdown(rows))
  if any(r["batch_size"] == 4 for r in rows):
    os.makedirs(os.path.dirname(cfg.plot) or ".", exist_ok=True)
    log(f"figure: {figure(rows, 4, cfg.plot)}")
  for c in result["comparisons"]:
    chain = c["chain"] + ("" if c["same_verified_tokens"] else " (the longest chain measured: fewer tokens verified)")
    log(f"T={c['temperature']:g} batch {c['batch_size']}: {c['tree']} {c['tree_accepted_per_round']:.2f} vs "
        f"{chain} {c['chain_accepted_per_round']:.2f} accepted / round: {c['ratio']:.2f}x")
  return result


def main(cfg: ml_collections.ConfigDict) -> None:
  run(cfg)


if __name__ == "__main__":
  harness.run_script(main, "Report config (configs/reports/trees.py).")
