"""Searches the layers a self-speculative (layer-skip) drafter should keep, in the spirit of SWIFT
(Xia et al. 2024): maximise the modelled speedup of a skip set, measured acceptance x cost.

  python -m experiments.layer_skip_search --config=configs/searches/layer_skip.py:qwen

Objective. For a kept set L (a subset of the target's N layers), decode the calibration prompts with
`drafter="layer_skip"`, `layer_skip.layers=L` (greedy, K draft tokens per round) and read the mean accepted
length m(L) (tokens per verify round, bonus included). A round costs K draft passes of relative cost
c(L) and one verify pass of relative cost v (a (K+1)-token forward over a 1-token one, measured), so
the modelled speedup over autoregressive decoding is m(L) / (K c(L) + v). c(L) is modelled as
c0 + (1 - c0) |L| / N (the output head and embedding cost c0, every block the same), with c0 fitted
from two measured ratios (one layer and all layers); the best set's c is measured directly at the end.

Search. Three families seed it (as SWIFT observes for untrained models, keeping the first and last
layers matters most): prefixes (early exit: layers 0..n-1), interleaved skips (keep the first and last
`edge` layers, every other layer between them), and the same with every third layer skipped. From the
best seed a greedy descent removes, one at a time, the middle-most kept layer that still improves the
objective, until the evaluation budget is spent. Every evaluation (set, m, alpha_hat, modelled c and
speedup) is written to the output JSON as it finishes.
"""

from __future__ import annotations

import time
from typing import Callable

import ml_collections

from experiments import harness
from specjax import costs, decode_spec, pipeline, records
from specjax.models.load import load_model
from specjax.speculative.drafters.base import DraftPass


def layer_spec(layers: tuple[int, ...]) -> str:
  """(0, 1, 2, 5, 7, 8) -> "0-2,5,7-8": the `draft_layers` syntax."""
  runs, start = [], layers[0]
  for previous, layer in zip(layers, layers[1:] + (None,)):
    if layer != previous + 1:
      runs.append(f"{start}" if start == previous else f"{start}-{previous}")
      start = layer
  return ",".join(runs)


def seeds(n_layers: int) -> list[tuple[int, ...]]:
  """The starting candidates: prefixes, and interleaved skips with kept edges (see the docstring)."""
  candidates = []
  for fraction in (0.5, 0.65, 0.8):
    candidates.append(tuple(range(max(1, round(n_layers * fraction)))))
  for edge in (2, 4):
    middle = range(edge, n_layers - edge)
    candidates.append(tuple(sorted(set(range(edge)) | set(middle[::2]) | set(range(n_layers - edge, n_layers)))))
    kept = [layer for i, layer in enumerate(middle) if i % 3 != 2]
    candidates.append(tuple(sorted(set(range(edge)) | set(kept) | set(range(n_layers - edge, n_layers)))))
  return list(dict.fromkeys(candidates))


def run(search: ml_collections.ConfigDict, log: Callable[[str], None] = print) -> dict:
  base = search.base
  decode_spec.from_config(base)
  records.check_output(search.output)
  target = load_model(base.target, dtype=base.dtype)
  n_layers = target.config.n_layers
  k = base.k
  t1, tk = (costs.forward_seconds(target.config, target.params, [1, k + 1], search.cost_repeats)[T] for T in (1, k + 1))
  verify_cost = tk / t1
  cost_of = lambda layers: costs.cost_ratio(
      target.config, target.params, DraftPass(target.config, target.params, layers=layers), 1, search.cost_repeats)
  c_one, c_all = cost_of((0,)), cost_of(tuple(range(n_layers)))
  per_layer = (c_all - c_one) / (n_layers - 1)
  modelled_c = lambda layers: c_one + per_layer * (len(layers) - 1)
  log(f"{base.target}: {n_layers} layers; verify cost v = {verify_cost:.2f} steps at K = {k}; c = "
      f"{c_one:.3f} (1 layer) .. {c_all:.3f} (all)")
  results = {
      "command": records.command(), "environment": records.environment(), "target": base.target, "n_layers": n_layers,
      "k": k, "verify_cost": verify_cost, "c_one_layer": c_one, "c_all_layers": c_all, "calibration": {
          "prompts": list(base.prompts), "max_new_tokens": base.max_new_tokens, "batch_size": base.batch_size
      }, "evaluations": []
  }
  evaluated = {}

  def evaluate(layers: tuple[int, ...]) -> float:
    if layers in evaluated:
      return evaluated[layers]
    cfg = base.copy_and_resolve_references()
    cfg.layer_skip.layers = layer_spec(layers)
    start = time.perf_counter()
    stats = pipeline.run(cfg, log=lambda message: None, models=(target, None))["stats"]
    m, c = stats["mean_accepted_length"], modelled_c(layers)
    speedup = m / (k * c + verify_cost)
    evaluated[layers] = speedup
    results["evaluations"].append({
        "draft_layers": cfg.layer_skip.layers, "kept": len(layers), "alpha_hat": stats["alpha_hat"],
        "mean_accepted_length": m, "modelled_c": c, "modelled_speedup": speedup, "seconds": time.perf_counter() - start
    })
    harness.write_results(results, search.output)
    log(f"[{len(evaluated)}/{search.max_evaluations}] {cfg.layer_skip.layers:>24} ({len(layers)}/{n_layers} layers): "
        f"alpha_hat {stats['alpha_hat']:.3f}, tokens/round {m:.2f}, c {c:.3f}, modelled speedup {speedup:.3f}")
    return speedup

  for layers in seeds(n_layers):
    if len(evaluated) < search.max_evaluations:
      evaluate(layers)
  best = max(evaluated, key=evaluated.get)
  while len(evaluated) < search.max_evaluations:
    centre = (n_layers - 1) / 2
    removable = sorted((layer for layer in best[1:-1]), key=lambda layer: abs(layer - centre))
    improved = False
    for layer in removable:
      if len(evaluated) >= search.max_evaluations:
        break
      candidate = tuple(x for x in best if x != layer)
      if candidate not in evaluated and evaluate(candidate) > evaluated[best]:
        best, improved = candidate, True
        break
    if not improved:
      break
  measured_c = cost_of(best)
  m = next(e for e in results["evaluations"] if e["draft_layers"] == layer_spec(best))["mean_accepted_length"]
  results["best"] = {
      "draft_layers": layer_spec(best), "kept": len(best), "measured_c": measured_c, "mean_accepted_length": m,
      "modelled_speedup_measured_c": m / (k * measured_c + verify_cost)
  }
  harness.write_results(results, search.output)
  log(f"best: draft_layers={layer_spec(best)} ({len(best)}/{n_layers} layers), measured c {measured_c:.3f}, "
      f"modelled speedup {results['best']['modelled_speedup_measured_c']:.3f}; wrote {search.output}")
  return results


def main(search: ml_collections.ConfigDict) -> None:
  run(search, log=harness.log)


if __name__ == "__main__":
  harness.run_script(main, "Search config (configs/searches/layer_skip.py).")
