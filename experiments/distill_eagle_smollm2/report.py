"""Results of the EAGLE head training on SmolLM2-135M (configs/distill_eagle_smollm2.py), and the inputs
of its decode sweep (`configs/sweeps/smollm2_eagle.py`).

Writes the head of the newest checkpoint in bfloat16 to `head` (experiments/distill_eagle_smollm2/head,
committed: `--config.drafter=eagle --config.draft=experiments/distill_eagle_smollm2/head` works from a
fresh clone), and into the work directory: the same head in float32 (`heads/step<N>`, specjax's head
layout), held-out prompts (`heldout_prompts.jsonl`, the
first 128 tokens of stdlib files the run never trained on: the same split, hence the same prompts, as
the distilled-draft run of `experiments/distill_smollm2/`) and the training files as the corpus that
ranks restricted heads. Here: results.json (held-out evaluations at step 0 and the newest) and
curves.png (held-out first-step acceptance, simulated accepted length at K = ttt_steps and the loss,
from metrics.jsonl). Reading checkpoints while the run goes on is safe (read-only). Settings:
configs/reports/distill.py.

  python -m experiments.distill_eagle_smollm2.report --config=configs/reports/distill.py:distill_eagle_smollm2
  python -m experiments.sweep --config=configs/sweeps/smollm2_eagle.py
"""

from __future__ import annotations

import json
import os

import ml_collections

from configs import distill_eagle_smollm2
from experiments import harness
from experiments.distill_smollm2.report import (held_out_prompts, heldout_evals, loss_panel, split, write_jsonl,
                                                write_train_corpus)
from specjax import records
from specjax.distill import log, train
from specjax.speculative.drafters.eagle_io import save_head


def plot(metrics_path: str, out: str, depth: int) -> None:
  from experiments import plots  # matplotlib, only here

  with open(metrics_path) as f:
    records_ = [json.loads(line) for line in f]
  evals = [r for r in records_ if r["split"] == "eval"]
  trains = [r for r in records_ if r["split"] == "train"]
  fig, (left, right) = plots.plt.subplots(1, 2, figsize=(11, 4))
  steps = [r["step"] for r in evals]
  left.plot(steps, [r["acceptance"] for r in evals], "o-", label="first-step expected acceptance, T = 1")
  left.plot(steps, [r["acceptance_length"] / depth for r in evals], "s-",
            label=f"simulated accepted tokens per round / {depth} (K = {depth})")
  left.set(xlabel="step", ylabel="held-out", ylim=(0, 1), title="EAGLE head on SmolLM2-135M")
  left.legend(fontsize=8)
  loss_panel(right, trains, evals, "train TTT loss", "held-out TTT loss")
  right.set(ylabel="sum_j 0.8^j KL (nats / token)", title="training-time test loss")
  plots.save_figure(fig, os.path.dirname(out) or ".", os.path.basename(out))


def main(cfg: ml_collections.ConfigDict) -> None:
  config = distill_eagle_smollm2.get_config()
  config.workdir = cfg.workdir
  teacher, head_config, head_params, vocab, step = train.latest(config)
  head_dir = os.path.join(cfg.workdir, "heads", f"step{step}")
  save_head(head_dir, head_config, head_params, vocab)
  if cfg.head:  # the committed copy: bfloat16, its vocabulary as token ids (rows come from the target)
    save_head(cfg.head, head_config, head_params, vocab, dtype="bfloat16")
  train_docs, held = split(config)
  prompts_file = write_jsonl(
      ({"prompt": p} for p in held_out_prompts(held, teacher.tokenizer, cfg.num_prompts, cfg.prompt_tokens)),
      os.path.join(cfg.workdir, "heldout_prompts.jsonl"))
  corpus_file = write_train_corpus(train_docs, os.path.join(cfg.workdir, "train_corpus.jsonl"))
  metrics_path = os.path.join(cfg.workdir, log.METRICS_FILE)
  evals = heldout_evals(cfg.workdir)
  results = {
      "checkpoint_step": step, "head": records.relative(head_dir), "committed_head": records.relative(cfg.head),
      "prompts_file": records.relative(prompts_file), "vocab_corpus": records.relative(corpus_file),
      "heldout": {"before": evals[0], "latest": evals[-1]}, "evals": evals, "environment": records.environment()
  }
  harness.write_results(results, cfg.output)
  plot(metrics_path, os.path.join(os.path.dirname(cfg.output), "curves.png"), config.student.ttt_steps)
  print(f"wrote {cfg.output}; head of step {step} in {head_dir}", flush=True)


if __name__ == "__main__":
  harness.run_script(main, "Report config (configs/reports/distill.py:distill_eagle_smollm2).")
