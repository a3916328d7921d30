"""Markdown tables from a `benchmark_decode.py` result, so the report quotes the JSON, never retypes it.

  python experiments/report_decode.py experiments/results/decode_cpu_float32.json
"""

from __future__ import annotations

import json
import sys

from specjax import metrics


def _fmt(value, digits: int = 2) -> str:
  if value is None:
    return "n/a"
  if isinstance(value, bool):
    return "yes" if value else "NO"
  return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _with_verify_cost(run: dict, ratios: dict) -> float | None:
  """Leviathan's formula with the measured cost of the (K+1)-token verify pass (batch 1 ratios)."""
  if run.get("alpha_hat") is None or run.get("batch_size") != 1 or str(run["k"] + 1) not in ratios:
    return None
  c = run.get("cost_ratio_c")
  return metrics.theoretical_speedup(run["alpha_hat"], run["k"], c, verify_cost=ratios[str(run["k"] + 1)])


def tables(result: dict) -> str:
  env = result["environment"]
  lines = [f"Command: `{result['command']}`  ",
           f"Machine: {env['processor']}, {env['platform']}, backend {env['backend']}; jax {env['jax']}, "
           f"flax {env['flax']}, transformers {env['transformers']}.", ""]
  sj = result.get("specjax")
  if sj:
    ratios = sj["target_forward_ratio"]
    lines += ["Target forward cost of T tokens relative to one token (batch 1): " +
              ", ".join(f"T={t}: {_fmt(r)}" for t, r in ratios.items()) +
              f"; one token = {sj['target_forward_s']['1'] * 1e3:.0f} ms. "
              "Draft/target cost ratio c: " + ", ".join(
                  f"{_fmt(c, 3)} (draft head {'full vocabulary' if v in ('0', 0) else f'{v} tokens'})"
                  for v, c in sj.get("cost_ratio_c_by_draft_vocab", {0: sj["cost_ratio_c"]}).items()) + ".", "",
              "| system | batch | K | draft head | tokens/s | speedup vs specjax AR | theory | "
              "theory with measured verify cost | α̂ | acceptance rate | mean accepted length | compile s | "
              "greedy output = AR |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in sj["runs"]:
      lines.append("| " + " | ".join([
          run["system"], str(run["batch_size"]), str(run.get("k", "")),
          {None: "", 0: "all"}.get(run.get("draft_vocab"), str(run.get("draft_vocab"))),
          _fmt(run["tokens_per_second"]) + (
              f" (mean of {len(run['tokens_per_second_runs'])}: " +
              ", ".join(_fmt(v) for v in run["tokens_per_second_runs"]) + ")"
              if "tokens_per_second_runs" in run else ""),
          _fmt(run.get("speedup_vs_specjax_autoregressive")), _fmt(run.get("theoretical_speedup")),
          _fmt(_with_verify_cost(run, ratios)),
          _fmt(run.get("alpha_hat"), 3), _fmt(run.get("acceptance_rate"), 3),
          _fmt(run.get("mean_accepted_length")), _fmt(run["compile_time_s"], 1),
          _fmt(run.get("outputs_match_autoregressive", ""))]) + " |")
  hf = result.get("transformers")
  if hf:
    best = max((r for r in (sj or {}).get("runs", []) if r["system"] == "specjax_speculative"
                and r["batch_size"] == 1), key=lambda r: r["tokens_per_second"], default=None)
    lines += ["", "| transformers system | batch | tokens/s | greedy output = specjax AR | fastest specjax "
              "speculative (batch 1) / this |", "|---|---|---|---|---|"]
    for run in hf:
      ratio = best["tokens_per_second"] / run["tokens_per_second"] if best and run["batch_size"] == 1 else None
      lines.append(f"| {run['system']} | {run['batch_size']} | {_fmt(run['tokens_per_second'])} | "
                   f"{_fmt(run['outputs_match_specjax_autoregressive'])} | {_fmt(ratio)} |")
  return "\n".join(lines)


if __name__ == "__main__":
  with open(sys.argv[1]) as f:
    print(tables(json.load(f)))
