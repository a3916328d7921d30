"""Decode benchmark on a real pair, all systems side by side in one run, one JSON result.

specjax autoregressive vs specjax speculative (K sweep) vs `transformers` `generate` without and with
`assistant_model`, on the same chat-formatted code prompts (identical input ids), greedy, same token
budget, batch sizes as given. Also measured in the same run: the target's cost of a T-token forward
(T = 1..9) relative to one step, and the draft/target cost ratio c, from which the theoretical speedup
of Leviathan et al. is computed for every K with the measured alpha_hat. Compile time is reported
separately and never counted in throughput. Greedy speculative outputs are checked token for token
against specjax's autoregressive outputs. The machine's speed drifts over a long run, so the
autoregressive baseline is rerun between speculative configs (`--ar-every`) and at the end; speedups
divide by the mean of those runs, whose spread is recorded.

  python experiments/benchmark_decode.py --out experiments/results/decode_cpu_float32.json
  python experiments/benchmark_decode.py --dtype bfloat16 --systems specjax --out ...gpu.json  # GPU
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import time

import jax
import ml_collections
import numpy as np

from experiments import hf_reference
from specjax import costs, drafting, metrics, pipeline, records
from specjax.decode_config import default_config

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring and tests.",
    "Implement binary search over a sorted list in Python and explain its complexity.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a Python function that parses a CSV file and returns the average of a numeric column.",
]

VOCAB_CORPUS = "stdlib"  # ranks the tokens of restricted draft heads (--draft-vocabs)


def decode_config(args, mode: str, k: int, batch_size: int, draft_vocab: int = 0) -> ml_collections.ConfigDict:
  cfg = default_config()
  cfg.update(target=args.target, draft=args.draft, mode=mode, prompts=tuple(PROMPTS[:args.num_prompts]),
             chat=True, max_new_tokens=args.max_new_tokens, k=k, draft_vocab=draft_vocab,
             draft_vocab_corpus=VOCAB_CORPUS, temperature=0.0, batch_size=batch_size, dtype=args.dtype)
  return cfg


def run_specjax(args, log) -> dict:
  base = decode_config(args, "speculative", 1, 1)
  target, draft = pipeline.load_models(base, log)
  result = {"target_forward_s": costs.forward_seconds(target.config, target.params, range(1, 10),
                                                      args.repeats)}
  result["draft_forward_s"] = costs.forward_seconds(draft.config, draft.params, range(1, 3), args.repeats)
  t1 = result["target_forward_s"][1]
  result["target_forward_ratio"] = {T: s / t1 for T, s in result["target_forward_s"].items()}
  c_by_vocab = {}  # draft/target cost ratio c per draft head size (0 = the full vocabulary)
  for vocab in args.draft_vocabs:
    head, _ = drafting.restricted_draft_head(vocab, VOCAB_CORPUS, target, draft, log)
    c_by_vocab[vocab] = costs.cost_ratio(target.config, target.params, draft.config, draft.params, 1,
                                         args.repeats, head)
  result["cost_ratio_c"] = c_by_vocab.get(0, result["draft_forward_s"][1] / t1)
  result["cost_ratio_c_by_draft_vocab"] = c_by_vocab
  log(f"target T=1 {t1 * 1e3:.0f} ms; ratios " +
      " ".join(f"{T}:{r:.2f}" for T, r in result["target_forward_ratio"].items()) +
      "; c " + " ".join(f"(vocab {v or 'all'}) {c:.3f}" for v, c in c_by_vocab.items()))
  runs = []
  for batch_size in args.batch_sizes:
    # The baseline runs first, after every `ar_every` speculative configs and last: speedups divide by
    # the mean of these runs, and their spread shows how much the machine drifted during the sweep.
    ar_speeds = []

    def autoregressive():
      ar = pipeline.run(decode_config(args, "autoregressive", 1, batch_size), log, (target, draft))
      ar_speeds.append(ar["stats"]["tokens_per_second"])
      log(f"specjax AR b{batch_size}: {ar_speeds[-1]:.2f} tok/s")
      return ar

    ar = autoregressive()
    ar_ids = [o["token_ids"] for o in ar["outputs"]]
    spec_runs = []
    specs = list(itertools.product(args.ks if batch_size == 1 else args.batched_ks, args.draft_vocabs))
    for number, (k, vocab) in enumerate(specs):
      if number and number % args.ar_every == 0:
        autoregressive()
      spec = pipeline.run(decode_config(args, "speculative", k, batch_size, vocab), log, (target, draft))
      stats = spec["stats"]
      alpha, c = stats["alpha_hat"], c_by_vocab[vocab]
      spec_runs.append({
          "system": "specjax_speculative", "batch_size": batch_size, "k": k, "draft_vocab": vocab, **stats,
          "cost_ratio_c": c,
          "theoretical_speedup": None if alpha is None else metrics.theoretical_speedup(alpha, k, c),
          "outputs_match_autoregressive": [o["token_ids"] for o in spec["outputs"]] == ar_ids})
      log(f"specjax spec b{batch_size} K={k} vocab {vocab or 'all'}: {stats['tokens_per_second']:.2f} tok/s, "
          f"alpha_hat {alpha}, theory {spec_runs[-1]['theoretical_speedup']}, "
          f"match {spec_runs[-1]['outputs_match_autoregressive']}")
    autoregressive()
    ar_mean = float(np.mean(ar_speeds))
    runs.append({"system": "specjax_autoregressive", "batch_size": batch_size, **ar["stats"],
                 "tokens_per_second": ar_mean, "tokens_per_second_runs": ar_speeds, "token_ids": ar_ids})
    for run in spec_runs:
      run["speedup_vs_specjax_autoregressive"] = run["tokens_per_second"] / ar_mean
    runs += spec_runs
    log(f"specjax AR b{batch_size}: mean {ar_mean:.2f} tok/s over {len(ar_speeds)} runs "
        f"({min(ar_speeds):.2f}-{max(ar_speeds):.2f}); speedups " +
        " ".join(f"K={r['k']}/{r['draft_vocab'] or 'all'}:{r['speedup_vs_specjax_autoregressive']:.2f}"
                 for r in spec_runs))
  result["runs"] = runs
  result["prompt_ids"] = pipeline.encode_prompts(target.tokenizer, PROMPTS[:args.num_prompts], chat=True)
  result["eos_ids"] = list(target.tokenizer.eos_ids)
  return result


def run_transformers(args, prompt_ids, eos_ids, reference_ids, log) -> list[dict]:
  """`generate` with and without the assistant, timed per call (the first call is a warm-up)."""
  start = time.perf_counter()
  target = hf_reference.hf_model(args.target)
  log(f"transformers loaded the target in {time.perf_counter() - start:.0f} s")
  runs = []

  timed = lambda batch_ids, **kwargs: hf_reference.generate(target, batch_ids, eos_ids, args.max_new_tokens,
                                                            **kwargs)

  def system(name, batch_size, **kwargs):
    timed([prompt_ids[0]], **kwargs)  # warm-up
    ids, seconds = [], 0.0
    for start in range(0, len(prompt_ids), batch_size):
      rows, elapsed = timed(prompt_ids[start:start + batch_size], **kwargs)
      ids += rows
      seconds += elapsed
    tokens = sum(len(r) for r in ids)
    runs.append({"system": name, "batch_size": batch_size, "generated_tokens": tokens,
                 "wall_time_s": seconds, "tokens_per_second": tokens / seconds,
                 "outputs_match_specjax_autoregressive": ids == reference_ids,
                 "token_ids": ids, **{k: v for k, v in kwargs.items() if k != "assistant_model"}})
    log(f"{name} b{batch_size}: {tokens / seconds:.2f} tok/s, match {ids == reference_ids}")

  for batch_size in args.hf_batch_sizes:
    system("transformers_generate", batch_size)
  if args.draft:
    start = time.perf_counter()
    assistant = hf_reference.hf_model(args.draft)
    log(f"transformers loaded the draft in {time.perf_counter() - start:.0f} s")
    system("transformers_assisted", 1, assistant_model=assistant)  # batch 1 only in transformers
  return runs


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
  parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--num-prompts", type=int, default=4)
  parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
  parser.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=list(range(1, 9)))
  parser.add_argument("--batched-ks", type=lambda s: [int(x) for x in s.split(",")], default=[3, 5],
                      help="K values run at batch sizes > 1")
  parser.add_argument("--draft-vocabs", type=lambda s: [int(x) for x in s.split(",")], default=[0, 32768],
                      help="draft head sizes (config.draft_vocab; 0 = the full vocabulary), each run at every K")
  parser.add_argument("--hf-batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--ar-every", type=int, default=6,
                      help="rerun the autoregressive baseline after this many speculative configs")
  parser.add_argument("--systems", default="specjax,transformers")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  log = lambda message: print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
  results = {"command": records.command(),
             "args": {k: records.relative(v) if isinstance(v, str) else v for k, v in vars(args).items()},
             "environment": records.environment(), "prompts": PROMPTS[:args.num_prompts]}
  systems = args.systems.split(",")
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  if "specjax" in systems:
    results["specjax"] = run_specjax(args, log)
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
    gc.collect()
    jax.clear_caches()
  if "transformers" in systems:
    import transformers

    results["environment"]["torch_transformers"] = transformers.__version__
    sj = results.get("specjax", {})
    reference = next((r["token_ids"] for r in sj.get("runs", []) if r["system"] == "specjax_autoregressive"), None)
    prompt_ids = sj.get("prompt_ids")
    eos_ids = sj.get("eos_ids")
    if prompt_ids is None:
      raise SystemExit("--systems transformers needs specjax in the same run (it supplies the input ids)")
    results["transformers"] = run_transformers(args, prompt_ids, eos_ids, reference, log)
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
  log(f"wrote {args.out}")


if __name__ == "__main__":
  main()
