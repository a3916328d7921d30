"""Results of the SmolLM2 distillation (configs/distill_smollm2.py): does the distilled draft decode faster?

Compares, on the same held-out prompts (the first `--prompt_tokens` tokens of stdlib files the run never
trained on, plain text, no chat template), the target's own autoregressive decoding with speculative
decoding drafted by (a) the undistilled layer-truncated draft and (b) the draft at the run's latest
checkpoint, greedy and at temperature 1. Also plots the run's held-out acceptance / agreement / loss
curves from metrics.jsonl. Timings share the CPU with whatever else runs: stop the training first
(or pause it: `kill -STOP PID`, later `kill -CONT PID`) for clean numbers.

  python -m experiments.distill_smollm2.report  # from the repo root; -> results.json, curves.png here
"""

from __future__ import annotations

import argparse
import json
import os

import ml_collections

from configs import distill_smollm2
from specjax import corpus, metrics, pipeline
from specjax.distill import data, student, train
from specjax.models.load import LoadedModel

HERE = os.path.dirname(os.path.abspath(__file__))


def held_out_prompts(config: ml_collections.ConfigDict, tokenizer, count: int, prompt_tokens: int) -> list[str]:
  """Prefixes of held-out documents (the run's own split), long enough to be `prompt_tokens` tokens."""
  docs = corpus.read_documents(config.data.source, config.data.pattern, config.data.jsonl_field)
  _, held = data.split_documents(docs, config.data.heldout_fraction, config.seed)
  prompts = []
  for doc in held:
    ids = tokenizer.encode(doc.text)
    if len(ids) > prompt_tokens:
      prompts.append(tokenizer.decode(ids[:prompt_tokens]))
    if len(prompts) == count:
      return prompts
  raise ValueError(f"only {len(prompts)} held-out documents have more than {prompt_tokens} tokens")


def decode(models, prompts, mode: str, temperature: float, args) -> dict:
  cfg = ml_collections.ConfigDict(dict(
      target="(loaded)", draft="(loaded)", mode=mode, prompts=tuple(prompts), prompts_file="", chat=False,
      max_new_tokens=args.max_new_tokens, k=args.k, temperature=temperature, top_k=0, top_p=1.0, seed=0,
      batch_size=1, dtype="float32", output=""))
  return pipeline.run(cfg, log=lambda m: None, models=models)


def plot(metrics_path: str, out: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  with open(metrics_path) as f:
    records = [json.loads(line) for line in f]
  evals = [r for r in records if r["split"] == "eval"]
  trains = [r for r in records if r["split"] == "train" and r["mode"] == "fixed"]  # comparable losses
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  steps = [r["step"] for r in evals]
  left.plot(steps, [r["acceptance"] for r in evals], "o-", label="expected acceptance E[sum min(p, q)], T=1")
  left.plot(steps, [r["greedy_agreement"] for r in evals], "s-", label="greedy agreement")
  left.set(xlabel="step", ylabel="held-out rate", ylim=(0, 1), title="SmolLM2-135M draft (4 of 30 layers)")
  left.legend()
  window = 20
  smooth = [sum(r["loss"] for r in trains[max(0, i - window + 1):i + 1]) / min(i + 1, window)
            for i in range(len(trains))]
  right.plot([r["step"] for r in trains], smooth, label=f"train forward KL, fixed-text batches ({window}-batch mean)")
  right.plot(steps, [r["loss"] for r in evals], "o", label="held-out forward KL")
  right.set(xlabel="step", ylabel="nats / token", yscale="log", title="distillation loss")
  right.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=120)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", default=os.path.join(HERE, "workdir"))
  parser.add_argument("--num_prompts", type=int, default=6)
  parser.add_argument("--prompt_tokens", type=int, default=128)
  parser.add_argument("--max_new_tokens", type=int, default=96)
  parser.add_argument("--k", type=int, default=3, help="draft tokens per round")
  parser.add_argument("--out", default=os.path.join(HERE, "results.json"))
  args = parser.parse_args()

  config = distill_smollm2.get_config()
  config.workdir = args.workdir
  target, distilled, step = train.latest_student(config)
  truncated = LoadedModel(f"{target.name}-truncated", *student.truncate(target.config, target.params,
                                                                         config.student.num_layers),
                          target.tokenizer)
  prompts = held_out_prompts(config, target.tokenizer, args.num_prompts, args.prompt_tokens)
  results = {"checkpoint_step": step, "k": args.k, "prompts": prompts, "runs": {}}
  for temperature in (0.0, 1.0):
    baseline = decode((target, None), prompts, "autoregressive", temperature, args)["stats"]
    runs = {"autoregressive": baseline}
    for name, draft in (("truncated", truncated), ("distilled", distilled)):
      stats = decode((target, draft), prompts, "speculative", temperature, args)["stats"]
      draft_alone = decode((draft, None), prompts, "autoregressive", temperature, args)["stats"]
      c = baseline["tokens_per_second"] / draft_alone["tokens_per_second"]  # draft / target step cost
      alpha = stats["alpha_hat"]
      runs[name] = {
          "acceptance_rate": stats["acceptance_rate"], "alpha_hat": alpha,
          "mean_accepted_length": stats["mean_accepted_length"], "tokens_per_second": stats["tokens_per_second"],
          "speedup": stats["tokens_per_second"] / baseline["tokens_per_second"], "cost_ratio_c": c,
          "theoretical_speedup": metrics.theoretical_speedup(alpha, args.k, c) if alpha is not None else None}
      print(f"T={temperature}: {name:9s} alpha_hat {alpha:.3f}  {stats['tokens_per_second']:.1f} tok/s  "
            f"speedup {runs[name]['speedup']:.2f}x (autoregressive {baseline['tokens_per_second']:.1f} tok/s)",
            flush=True)
    results["runs"][f"temperature_{temperature:g}"] = runs
  with open(os.path.join(args.workdir, train.METRICS_FILE)) as f:
    evals = [r for line in f if (r := json.loads(line))["split"] == "eval"]
  results["heldout"] = {"before": evals[0], "latest": evals[-1]}
  results["environment"] = pipeline.environment()
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)
  plot(os.path.join(args.workdir, train.METRICS_FILE), os.path.join(os.path.dirname(args.out), "curves.png"))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
