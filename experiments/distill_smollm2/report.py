"""Results of the SmolLM2 distillation (configs/distill_smollm2.py): does the distilled draft decode faster?

Compares, on the same held-out prompts (the first `--prompt_tokens` tokens of stdlib files the run never
trained on, plain text, no chat template), the target's own autoregressive decoding with speculative
decoding drafted by (a) the undistilled layer-truncated draft and (b) the draft at the run's latest
checkpoint, greedy and at temperature 1, each with its full output head and with the head restricted
to the `--draft_vocabs` most frequent tokens of the run's *training* files (`config.draft_vocab`;
written once to `train_corpus.jsonl` in the work directory, so no held-out text ranks the tokens). The
cost ratio c of each draft is timed by `specjax.costs` (1-token forwards). Also plots the run's held-out acceptance / agreement / loss
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
from specjax import corpus, costs, metrics, pipeline
from specjax.distill import data, student, train
from specjax.models.load import LoadedModel

HERE = os.path.dirname(os.path.abspath(__file__))


def split(config: ml_collections.ConfigDict) -> tuple[list[corpus.Document], list[corpus.Document]]:
  """The run's own (train, held-out) documents."""
  docs = corpus.read_documents(config.data.source, config.data.pattern, config.data.jsonl_field)
  return data.split_documents(docs, config.data.heldout_fraction, config.seed)


def write_train_corpus(train_docs: list[corpus.Document], path: str) -> str:
  """The training documents as a JSONL corpus ("text" fields) for ranking the draft vocabulary."""
  if not os.path.exists(path):
    with open(f"{path}.tmp", "w") as f:
      for doc in train_docs:
        f.write(json.dumps({"text": doc.text}) + "\n")
    os.replace(f"{path}.tmp", path)
  return path


def held_out_prompts(held: list[corpus.Document], tokenizer, count: int, prompt_tokens: int) -> list[str]:
  """Prefixes of held-out documents, long enough to be `prompt_tokens` tokens."""
  prompts = []
  for doc in held:
    ids = tokenizer.encode(doc.text)
    if len(ids) > prompt_tokens:
      prompts.append(tokenizer.decode(ids[:prompt_tokens]))
    if len(prompts) == count:
      return prompts
  raise ValueError(f"only {len(prompts)} held-out documents have more than {prompt_tokens} tokens")


def decode_config(prompts, mode: str, temperature: float, args, draft_vocab: int = 0,
                  vocab_corpus: str = "") -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      target="(loaded)", draft="(loaded)", mode=mode, prompts=tuple(prompts), prompts_file="", chat=False,
      max_new_tokens=args.max_new_tokens, k=args.k, draft_vocab=draft_vocab, draft_vocab_corpus=vocab_corpus,
      temperature=temperature, top_k=0, top_p=1.0, seed=0, batch_size=1, dtype="float32", output=""))


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
  parser.add_argument("--draft_vocabs", type=lambda v: [int(x) for x in v.split(",") if x], default=[8192],
                      help="restricted draft head sizes also run (comma-separated; empty = full head only)")
  parser.add_argument("--repeats", type=int, default=10, help="timed forwards per cost ratio c")
  parser.add_argument("--out", default=os.path.join(HERE, "results.json"))
  args = parser.parse_args()

  config = distill_smollm2.get_config()
  config.workdir = args.workdir
  target, distilled, step = train.latest_student(config)
  truncated = LoadedModel(f"{target.name}-truncated", *student.truncate(target.config, target.params,
                                                                         config.student.num_layers),
                          target.tokenizer)
  train_docs, held = split(config)
  prompts = held_out_prompts(held, target.tokenizer, args.num_prompts, args.prompt_tokens)
  vocab_corpus = write_train_corpus(train_docs, os.path.join(args.workdir, "train_corpus.jsonl"))
  drafts = {"truncated": truncated, "distilled": distilled}
  variants = [(name, vocab) for name in drafts for vocab in [0, *args.draft_vocabs]]
  cost = {}  # (draft, vocabulary) -> c, timed once
  for name, vocab in variants:
    head, _ = pipeline.restricted_draft_head(vocab, vocab_corpus, target, drafts[name], print)
    cost[name, vocab] = costs.cost_ratio(target, drafts[name], 1, args.repeats, head)
  results = {"checkpoint_step": step, "k": args.k, "prompts": prompts, "runs": {},
             "cost_ratio_c": {f"{name}/{vocab or 'all'}": c for (name, vocab), c in cost.items()}}
  for temperature in (0.0, 1.0):
    baseline = pipeline.run(decode_config(prompts, "autoregressive", temperature, args), log=lambda m: None,
                            models=(target, None))["stats"]
    runs = {"autoregressive": baseline}
    for name, vocab in variants:
      stats = pipeline.run(decode_config(prompts, "speculative", temperature, args, vocab, vocab_corpus),
                           log=lambda m: None, models=(target, drafts[name]))["stats"]
      alpha, c = stats["alpha_hat"], cost[name, vocab]
      label = name if not vocab else f"{name}, {vocab}-token head"
      runs[label] = {
          "draft_vocab": vocab, "draft_vocab_coverage": stats["draft_vocab_coverage"],
          "acceptance_rate": stats["acceptance_rate"], "alpha_hat": alpha,
          "mean_accepted_length": stats["mean_accepted_length"], "tokens_per_second": stats["tokens_per_second"],
          "speedup": stats["tokens_per_second"] / baseline["tokens_per_second"], "cost_ratio_c": c,
          "theoretical_speedup": metrics.theoretical_speedup(alpha, args.k, c) if alpha is not None else None}
      print(f"T={temperature}: {label:28s} alpha_hat {alpha:.3f}  c {c:.3f}  {stats['tokens_per_second']:.1f} "
            f"tok/s  speedup {runs[label]['speedup']:.2f}x (autoregressive {baseline['tokens_per_second']:.1f} "
            f"tok/s)", flush=True)
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
