"""Results of the SmolLM2 distillation (configs/distill_smollm2.py), and the inputs of its decode sweep.

Writes into the work directory what `configs/sweeps/smollm2_distill.py` decodes: the draft the run
started from (the layer-truncated target, undistilled) and the draft of its latest checkpoint as HF
directories (`drafts/step0`, `drafts/step<N>`); held-out prompts (`heldout_prompts.jsonl`: the first
`prompt_tokens` tokens of stdlib files the run never trained on); and the training files as a JSONL
corpus (`train_corpus.jsonl`) that ranks the restricted draft heads, so no held-out text ranks tokens.
Here it writes results.json (held-out evaluations before and at the latest step) and curves.png (the
run's held-out acceptance, agreement and loss from metrics.jsonl). Reading checkpoints while the
training runs is safe (read-only). Settings: configs/reports/distill.py.

  python -m experiments.distill_smollm2.report --config=configs/reports/distill.py:distill_smollm2
  python -m experiments.sweep --config=configs/sweeps/smollm2_distill.py
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import ml_collections

from configs import distill_smollm2
from experiments import harness
from specjax import corpus, records
from specjax.distill import data, log, train
from specjax.distill.export import export_hf
from specjax.models.load import LoadedModel


def split(config: ml_collections.ConfigDict) -> tuple[list[corpus.Document], list[corpus.Document]]:
  """The run's own (train, held-out) documents."""
  docs = corpus.read_documents(config.data.source, config.data.pattern, config.data.jsonl_field)
  return data.split_documents(docs, config.data.heldout_fraction, config.seed)


def write_jsonl(records: Iterable[dict], path: str) -> str:
  """Writes one JSON record per line, through a temporary file (no half-written file); returns `path`."""
  with open(f"{path}.tmp", "w") as f:
    f.writelines(json.dumps(record) + "\n" for record in records)
  os.replace(f"{path}.tmp", path)
  return path


def write_train_corpus(train_docs: list[corpus.Document], path: str) -> str:
  """The training documents as a JSONL corpus ("text" fields) for ranking the draft vocabulary."""
  return path if os.path.exists(path) else write_jsonl(({"text": doc.text} for doc in train_docs), path)


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


def loss_panel(ax, trains: list[dict], evals: list[dict], train_label: str, eval_label: str, window: int = 20) -> None:
  """The train loss (a `window`-record running mean) and the held-out loss against step, log scale."""
  smooth = [
      sum(r["loss"] for r in trains[max(0, i - window + 1):i + 1]) / min(i + 1, window) for i in range(len(trains))
  ]
  ax.plot([r["step"] for r in trains], smooth, label=f"{train_label} ({window}-step mean)")
  ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o", label=eval_label)
  ax.set(xlabel="step", yscale="log")
  ax.legend(fontsize=8)


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
  loss_panel(right, trains, evals, "train forward KL, fixed-text batches", "held-out forward KL")
  right.set(ylabel="nats / token", title="distillation loss")
  fig.tight_layout()
  fig.savefig(out, dpi=120)


def prepare(config: ml_collections.ConfigDict, num_prompts: int, prompt_tokens: int) -> dict:
  """Writes what the before/after sweep decodes with into `config.workdir`: drafts/step0 (the
  undistilled draft the run started from) and drafts/step<N> (its latest checkpoint) as HF directories,
  heldout_prompts.jsonl and train_corpus.jsonl. Returns the paths and N."""
  teacher, distilled, step = train.latest(config)
  undistilled = LoadedModel(f"{teacher.name}-draft-step0", *train.init_student(config, teacher), teacher.tokenizer)
  train_docs, held = split(config)
  drafts = os.path.join(config.workdir, "drafts")
  exported = {
      name: export_hf(os.path.join(drafts, f"step{s}"), model.config, model.params, teacher.tokenizer)
      for name, s, model in (("undistilled", 0, undistilled), ("distilled", step, distilled))
  }
  paths = {
      "checkpoint_step": step, "prompts_file": os.path.join(config.workdir, "heldout_prompts.jsonl"),
      "vocab_corpus": write_train_corpus(train_docs, os.path.join(config.workdir, "train_corpus.jsonl")), **exported
  }
  prompts = held_out_prompts(held, teacher.tokenizer, num_prompts, prompt_tokens)
  write_jsonl(({"prompt": p} for p in prompts), paths["prompts_file"])
  return paths


def heldout_evals(workdir: str) -> list[dict]:
  """The run's held-out evaluation records (metrics.jsonl), in step order."""
  with open(os.path.join(workdir, log.METRICS_FILE)) as f:
    return [r for line in f if (r := json.loads(line))["split"] == "eval"]


def main(cfg: ml_collections.ConfigDict) -> None:
  config = distill_smollm2.get_config()
  config.workdir = cfg.workdir
  results = {
      k: records.relative(v) if isinstance(v, str) else v  # paths from the repo root
      for k, v in prepare(config, cfg.num_prompts, cfg.prompt_tokens).items()
  }
  evals = heldout_evals(cfg.workdir)
  results["heldout"] = {"before": evals[0], "latest": evals[-1]}
  results["environment"] = records.environment()
  harness.write_results(results, cfg.output)
  plot(os.path.join(cfg.workdir, log.METRICS_FILE), os.path.join(os.path.dirname(cfg.output), "curves.png"))
  print(f"wrote {cfg.output}; decode them with configs/sweeps/smollm2_distill.py", flush=True)


if __name__ == "__main__":
  harness.run_script(main, "Report config (configs/reports/distill.py:distill_smollm2).")
