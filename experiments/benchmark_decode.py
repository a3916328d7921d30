"""Decode benchmark on a real pair, all systems side by side in one run, one JSON result.

specjax autoregressive vs specjax speculative (K sweep) vs `transformers` `generate` without and with
`assistant_model`, on the same chat-formatted code prompts (identical input ids), greedy, same token
budget, batch sizes as given. Also measured in the same run: the target's cost of a T-token forward
(T = 1..9) relative to one step, and the draft/target cost ratio c, from which the theoretical speedup
of Leviathan et al. is computed for every K with the measured alpha_hat. Compile time is reported
separately and never counted in throughput. Greedy speculative outputs are checked token for token
against specjax's autoregressive outputs. The machine's speed drifts over a long run, so the
autoregressive baseline is rerun between speculative configs (`ar_every`) and at the end; speedups
divide by the mean of those runs, whose spread is recorded. The settings are configs/benchmarks/decode.py.

  python -m experiments.benchmark_decode --config=configs/benchmarks/decode.py
  python -m experiments.benchmark_decode --config=configs/benchmarks/decode.py --config.dtype=bfloat16 \
      --config.systems='("specjax",)' --config.output=experiments/results/decode_gpu_bfloat16.json  # GPU
  python -m experiments.benchmark_decode --config=configs/benchmarks/decode.py \
      --config.report=experiments/results/decode_cpu_float32.json  # the tables of a results file

The tables (markdown) quote the JSON, so that the report never retypes a number.
"""

from __future__ import annotations

import gc
import itertools
import time

import jax
import ml_collections
import numpy as np

from experiments import harness, hf_reference
from specjax import costs, metrics, pipeline, prompts, records
from specjax.api import apply_fields
from specjax.speculative.drafters.base import DraftPass
from specjax.speculative.drafters.draft_head import restricted_draft_head
from specjax.decode_config import default_config
from specjax.errors import ConfigError

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring and tests.",
    "Implement binary search over a sorted list in Python and explain its complexity.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a Python function that parses a CSV file and returns the average of a numeric column.",
    # More requests of the same kind, for batches of 8 (the benchmarks take the first N).
    "Write a Python function that merges two sorted lists into one sorted list, with tests.",
    "Implement a least-recently-used cache class in Python with get and put methods.",
    "Write a Python function that counts the words in a text file and returns the ten most common.",
    "Write a Python function that validates an email address with a regular expression and explain it.",
]

VOCAB_CORPUS = "stdlib"  # ranks the tokens of restricted draft heads (config.draft_vocabs: decode field model.vocab)
SYSTEMS = ("specjax", "transformers")


def decode_config(cfg, mode: str, k: int, batch_size: int, draft_vocab: int = 0) -> ml_collections.ConfigDict:
  return apply_fields(
      default_config(),
      dict(target=cfg.target, draft=cfg.draft, mode=mode, prompts=tuple(PROMPTS[:cfg.num_prompts]), chat=True,
           max_new_tokens=cfg.max_new_tokens, k=k, k_policy="fixed", model=dict(vocab=draft_vocab,
                                                                                vocab_corpus=VOCAB_CORPUS),
           temperature=0.0, batch_size=batch_size, dtype=cfg.dtype))


def run_specjax(cfg, log) -> dict:
  base = decode_config(cfg, "speculative", 1, 1)
  target, draft = pipeline.load_models(base, log)
  result = {"target_forward_s": costs.forward_seconds(target.config, target.params, range(1, 10), cfg.repeats)}
  result["draft_forward_s"] = costs.forward_seconds(draft.config, draft.params, range(1, 3), cfg.repeats)
  t1 = result["target_forward_s"][1]
  result["target_forward_ratio"] = {T: s / t1 for T, s in result["target_forward_s"].items()}
  c_by_vocab = {}  # draft/target cost ratio c per draft head size (0 = the full vocabulary)
  for vocab in cfg.draft_vocabs:
    head, _ = restricted_draft_head(vocab, VOCAB_CORPUS, target, draft, log)
    c_by_vocab[vocab] = costs.cost_ratio(target.config, target.params, DraftPass(draft.config, draft.params, head), 1,
                                         cfg.repeats)
  result["cost_ratio_c"] = c_by_vocab.get(0, result["draft_forward_s"][1] / t1)
  result["cost_ratio_c_by_draft_vocab"] = c_by_vocab
  log(f"target T=1 {t1 * 1e3:.0f} ms; ratios " +
      " ".join(f"{T}:{r:.2f}" for T, r in result["target_forward_ratio"].items()) + "; c " +
      " ".join(f"(vocab {v or 'all'}) {c:.3f}" for v, c in c_by_vocab.items()))
  runs = []
  for batch_size in cfg.batch_sizes:
    # The baseline runs first, after every `ar_every` speculative configs and last: speedups divide by
    # the mean of these runs, and their spread shows how much the machine drifted during the sweep.
    ar_speeds = []

    def autoregressive():
      ar = pipeline.run(decode_config(cfg, "autoregressive", 1, batch_size), log, (target, draft))
      ar_speeds.append(ar["stats"]["tokens_per_second"])
      log(f"specjax AR b{batch_size}: {ar_speeds[-1]:.2f} tok/s")
      return ar

    ar = autoregressive()
    ar_ids = [o["token_ids"] for o in ar["outputs"]]
    spec_runs = []
    specs = list(itertools.product(cfg.ks if batch_size == 1 else cfg.batched_ks, cfg.draft_vocabs))
    for number, (k, vocab) in enumerate(specs):
      if number and number % cfg.ar_every == 0:
        autoregressive()
      spec = pipeline.run(decode_config(cfg, "speculative", k, batch_size, vocab), log, (target, draft))
      stats = spec["stats"]
      alpha, c = stats["alpha_hat"], c_by_vocab[vocab]
      spec_runs.append({
          "system": "specjax_speculative", "batch_size": batch_size, "k": k, "draft_vocab": vocab,
          **stats, "cost_ratio_c": c,
          "theoretical_speedup": None if alpha is None else metrics.theoretical_speedup(alpha, k, c),
          "outputs_match_autoregressive": [o["token_ids"] for o in spec["outputs"]] == ar_ids
      })
      log(f"specjax spec b{batch_size} K={k} vocab {vocab or 'all'}: {stats['tokens_per_second']:.2f} tok/s, "
          f"alpha_hat {alpha}, theory {spec_runs[-1]['theoretical_speedup']}, "
          f"match {spec_runs[-1]['outputs_match_autoregressive']}")
    autoregressive()
    ar_mean = float(np.mean(ar_speeds))
    runs.append({
        "system": "specjax_autoregressive", "batch_size": batch_size, **ar["stats"], "tokens_per_second": ar_mean,
        "tokens_per_second_runs": ar_speeds, "token_ids": ar_ids
    })
    for run in spec_runs:
      run["speedup_vs_specjax_autoregressive"] = run["tokens_per_second"] / ar_mean
    runs += spec_runs
    log(f"specjax AR b{batch_size}: mean {ar_mean:.2f} tok/s over {len(ar_speeds)} runs "
        f"({min(ar_speeds):.2f}-{max(ar_speeds):.2f}); speedups " + " ".join(
            f"K={r['k']}/{r['draft_vocab'] or 'all'}:{r['speedup_vs_specjax_autoregressive']:.2f}" for r in spec_runs))
  result["runs"] = runs
  result["prompt_ids"] = prompts.encode(target.tokenizer, PROMPTS[:cfg.num_prompts], chat=True)
  result["eos_ids"] = list(target.tokenizer.eos_ids)
  return result


def run_transformers(cfg, prompt_ids, eos_ids, reference_ids, log) -> list[dict]:
  """`generate` with and without the assistant, timed per call (the first call is a warm-up)."""
  start = time.perf_counter()
  target = hf_reference.hf_model(cfg.target)
  log(f"transformers loaded the target in {time.perf_counter() - start:.0f} s")
  runs = []

  timed = lambda batch_ids, **kwargs: hf_reference.generate(target, batch_ids, eos_ids, cfg.max_new_tokens, **kwargs)

  def system(name, batch_size, **kwargs):
    timed([prompt_ids[0]], **kwargs)  # warm-up
    ids, seconds = [], 0.0
    for start in range(0, len(prompt_ids), batch_size):
      rows, elapsed = timed(prompt_ids[start:start + batch_size], **kwargs)
      ids += rows
      seconds += elapsed
    tokens = sum(len(r) for r in ids)
    runs.append({
        "system": name, "batch_size": batch_size, "generated_tokens": tokens, "wall_time_s": seconds,
        "tokens_per_second": tokens / seconds, "outputs_match_specjax_autoregressive": ids == reference_ids,
        "token_ids": ids, **{k: v for k, v in kwargs.items() if k != "assistant_model"}
    })
    log(f"{name} b{batch_size}: {tokens / seconds:.2f} tok/s, match {ids == reference_ids}")

  for batch_size in cfg.hf_batch_sizes:
    system("transformers_generate", batch_size)
  if cfg.draft:
    start = time.perf_counter()
    assistant = hf_reference.hf_model(cfg.draft)
    log(f"transformers loaded the draft in {time.perf_counter() - start:.0f} s")
    system("transformers_assisted", 1, assistant_model=assistant)  # batch 1 only in transformers
  return runs


def check(cfg: ml_collections.ConfigDict) -> None:
  """Fails with a `ConfigError` naming the field before anything loads."""
  if not cfg.output:
    raise ConfigError("config.output is empty: name the results file (or config.report to print one)")
  if not cfg.systems or not set(cfg.systems) <= set(SYSTEMS):
    raise ConfigError(f"config.systems must name some of {SYSTEMS}, got {cfg.systems}")
  if "transformers" in cfg.systems and "specjax" not in cfg.systems:
    raise ConfigError("config.systems: transformers needs specjax in the same run (it supplies the input ids)")
  if not 1 <= cfg.num_prompts <= len(PROMPTS):
    raise ConfigError(f"config.num_prompts must be in 1..{len(PROMPTS)}, got {cfg.num_prompts}")


def run(cfg: ml_collections.ConfigDict, log: harness.Log = print) -> dict:
  """Runs the systems of `cfg`; returns the results, also written to `cfg.output`."""
  check(cfg)
  results = {
      "command": records.command(),
      "args": {k: records.relative(v) if isinstance(v, str) else v for k, v in cfg.to_dict().items()},
      "environment": records.environment(), "prompts": PROMPTS[:cfg.num_prompts]
  }
  if "specjax" in cfg.systems:
    results["specjax"] = run_specjax(cfg, log)
    harness.write_results(results, cfg.output)
    gc.collect()
    jax.clear_caches()
  if "transformers" in cfg.systems:
    import transformers

    results["environment"]["torch_transformers"] = transformers.__version__
    sj = results["specjax"]
    reference = next((r["token_ids"] for r in sj["runs"] if r["system"] == "specjax_autoregressive"), None)
    results["transformers"] = run_transformers(cfg, sj["prompt_ids"], sj["eos_ids"], reference, log)
    harness.write_results(results, cfg.output)
  log(f"wrote {cfg.output}")
  return results


def _cell(value, digits: int = 2) -> str:
  """A table cell: a float to `digits` decimals, a boolean as yes / NO, n/a for None, else as it is."""
  if isinstance(value, bool):
    return "yes" if value else "NO"
  return harness.number(value, f".{digits}f") if value is None or isinstance(value, float) else str(value)


def _with_verify_cost(run: dict, ratios: dict) -> float | None:
  """Leviathan's formula with the measured cost of the (K+1)-token verify pass (batch 1 ratios)."""
  if run.get("alpha_hat") is None or run.get("batch_size") != 1 or str(run["k"] + 1) not in ratios:
    return None
  c = run.get("cost_ratio_c")
  return metrics.theoretical_speedup(run["alpha_hat"], run["k"], c, verify_cost=ratios[str(run["k"] + 1)])


def tables(result: dict) -> str:
  """The results as markdown: the forward costs, one row per specjax run, then the transformers runs."""
  env = result["environment"]
  lines = [
      f"Command: `{result['command']}`  ",
      f"Machine: {env['processor']}, {env['platform']}, backend {env['backend']}; jax {env['jax']}, "
      f"flax {env['flax']}, transformers {env['transformers']}.", ""
  ]
  sj = result.get("specjax")
  if sj:
    ratios = sj["target_forward_ratio"]
    lines += [
        "Target forward cost of T tokens relative to one token (batch 1): " +
        ", ".join(f"T={t}: {_cell(r)}" for t, r in ratios.items()) +
        f"; one token = {sj['target_forward_s']['1'] * 1e3:.0f} ms. "
        "Draft/target cost ratio c: " +
        ", ".join(f"{_cell(c, 3)} (draft head {'full vocabulary' if v in ('0', 0) else f'{v} tokens'})"
                  for v, c in sj.get("cost_ratio_c_by_draft_vocab", {0: sj["cost_ratio_c"]}).items()) + ".", "",
        "| system | batch | K | draft head | tokens/s | speedup vs specjax AR | theory | "
        "theory with measured verify cost | α̂ | acceptance rate | mean accepted length | compile s | "
        "greedy output = AR |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    ]
    for run in sj["runs"]:
      lines.append("| " + " | ".join([
          run["system"],
          str(run["batch_size"]),
          str(run.get("k", "")), {None: "", 0: "all"}.get(run.get("draft_vocab"), str(run.get("draft_vocab"))),
          _cell(run["tokens_per_second"]) +
          (f" (mean of {len(run['tokens_per_second_runs'])}: " +
           ", ".join(_cell(v) for v in run["tokens_per_second_runs"]) + ")" if "tokens_per_second_runs" in run else ""),
          _cell(run.get("speedup_vs_specjax_autoregressive")),
          _cell(run.get("theoretical_speedup")),
          _cell(_with_verify_cost(run, ratios)),
          _cell(run.get("alpha_hat"), 3),
          _cell(run.get("acceptance_rate"), 3),
          _cell(run.get("mean_accepted_length")),
          _cell(run["compile_time_s"], 1),
          _cell(run.get("outputs_match_autoregressive", ""))
      ]) + " |")
  hf = result.get("transformers")
  if hf:
    best = max((r for r in (sj or {}).get("runs", []) if r["system"] == "specjax_speculative" and r["batch_size"] == 1),
               key=lambda r: r["tokens_per_second"], default=None)
    lines += [
        "", "| transformers system | batch | tokens/s | greedy output = specjax AR | fastest specjax "
        "speculative (batch 1) / this |", "|---|---|---|---|---|"
    ]
    for run in hf:
      ratio = best["tokens_per_second"] / run["tokens_per_second"] if best and run["batch_size"] == 1 else None
      lines.append(f"| {run['system']} | {run['batch_size']} | {_cell(run['tokens_per_second'])} | "
                   f"{_cell(run['outputs_match_specjax_autoregressive'])} | {_cell(ratio)} |")
  return "\n".join(lines)


def main(cfg: ml_collections.ConfigDict) -> None:
  harness.report_or_run(cfg, run, tables)


if __name__ == "__main__":
  harness.run_script(main, "Benchmark config (configs/benchmarks/decode.py).")
