"""A distillation run's records: metrics.jsonl, TensorBoard and console progress (`Log`), the stop on a
non-finite loss, and the summary's before/after lines. Family-neutral: it reads whatever metrics the
objective's steps return ("loss", "grad_norm", "learning_rate" in training; the eval sums' means)."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Callable

import ml_collections

from specjax import mesh as meshes
from specjax.distill import tensorboard
from specjax.distill.checkpoint import Checkpointer

METRICS_FILE = "metrics.jsonl"  # in the work directory


def _append(path: str, record: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def _rewind_metrics(path: str, step: int) -> None:
  """Drops the records a resumed run will write again: train records after `step`, evals from it."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  kept = [r for r in records if r["step"] < step or (r["step"] == step and r["split"] == "train")]
  with open(path + ".tmp", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in kept)
  os.replace(path + ".tmp", path)


def check_finite(step: int, metrics: dict, checkpoints: Checkpointer) -> None:
  """Stops the run on a non-finite loss or gradient norm, naming the step, the checkpoint this run
  started from (a damaged one would be the culprit, not the learning rate; restores are verified) and
  the last checkpoint saved."""
  if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
    checkpoints.wait()
    if checkpoints.restored is None:
      origin = "this run started from scratch"
    else:
      restored, verified = checkpoints.restored
      origin = (f"this run resumed from {'verified' if verified else 'unverified (no checksums)'} checkpoint "
                f"step {restored} in {checkpoints.step_path(restored)}")
    last = checkpoints.latest_step()
    kept = f"the last good checkpoint is step {last} in {checkpoints.step_path(last)}" if last is not None \
        else "no checkpoint was saved yet"
    raise FloatingPointError(
        f"non-finite training loss {metrics['loss']} / gradient norm {metrics['grad_norm']} at step {step}; "
        f"stopping ({origin}; {kept}). Rerunning resumes from it and will diverge again: lower "
        "optim.learning_rate, tighten optim.grad_clip or inspect the data first.")


class Log:
  """metrics.jsonl records and console progress; train metrics are fetched one step late.

  A train record's `tokens_per_s` is its valid tokens over the wall time since the previous record
  (evaluations excluded; the first one after a start includes compilation)."""
  def __init__(self, workdir: str, config: ml_collections.ConfigDict, start: int, checkpoints: Checkpointer,
               on_step: Callable[[int, dict], None]):
    self.path = os.path.join(workdir, METRICS_FILE)
    self.main = meshes.is_main_process()  # only process 0 writes and prints
    if self.main:
      _rewind_metrics(self.path, start)
    self.board = tensorboard.TensorBoard(workdir, start) if config.tensorboard and self.main else None
    self.config, self.start, self.checkpoints, self.on_step = config, start, checkpoints, on_step
    self.pending = None  # (step, device metrics, host info) of a step not yet fetched
    self.t_start = self.t_last = self.t_previous = time.time()
    self.tokens_since = 0

  def train(self, step: int, device_metrics: dict, info: dict) -> None:
    """Queues this step's metrics and records the previous step's (by now computed)."""
    previous, self.pending = self.pending, (step, device_metrics, info)
    if previous:
      self._record(*previous)

  def flush(self) -> None:
    """Records the queued step now (before a checkpoint: never save a step whose loss is unchecked)."""
    if self.pending:
      self._record(*self.pending)
      self.pending = None

  def _record(self, step: int, device_metrics: dict, info: dict) -> None:
    host_metrics = meshes.to_host(device_metrics)
    record = {"step": step, "split": "train", **{k: float(v) for k, v in host_metrics.items()}, **info}
    check_finite(step, record, self.checkpoints)
    now = time.time()
    record["tokens_per_s"], self.t_previous = info["tokens"] / max(now - self.t_previous, 1e-9), now
    self._write(record)
    self.on_step(step, record)
    self.tokens_since += info["tokens"]
    if self.main and (step % self.config.log_every == 0 or step == self.config.num_steps):
      rate = self.tokens_since / max(now - self.t_last, 1e-9)
      eta = (self.config.num_steps - step) * (now - self.t_start) / max(step - self.start, 1)
      print(
          f"step {step:6d}/{self.config.num_steps}  loss {record['loss']:.4f}  grad norm "
          f"{record['grad_norm']:.3f}  lr {record['learning_rate']:.2e}  {rate:,.0f} tok/s  "
          f"eta {eta / 60:.1f} min", flush=True)
      self.t_last, self.tokens_since = now, 0

  def eval(self, step: int, metrics: dict) -> None:
    self._write({"step": step, "split": "eval", **metrics})
    if self.main:
      third = _third(metrics)
      print(
          f"step {step:6d} eval  loss {metrics['loss']:.4f}  acceptance {metrics['acceptance']:.4f}  "
          f"{third.replace('_', ' ')} {metrics[third]:.4f}", flush=True)
    self.t_previous = time.time()

  def _write(self, record: dict) -> None:
    if not self.main:
      return
    _append(self.path, record)
    if self.board:
      self.board.write(record)

  def close(self) -> None:
    if self.board:
      self.board.close()

  def first_and_last_eval(self) -> tuple[dict, dict]:
    with open(self.path) as f:
      evals = [r for line in f if (r := json.loads(line))["split"] == "eval"]
    return evals[0], evals[-1]


def _third(metrics: dict) -> str:
  """The metric shown beside the loss and the acceptance: a draft model's greedy agreement, a head's
  acceptance length."""
  return "greedy_agreement" if "greedy_agreement" in metrics else "acceptance_length"


def print_before_and_after(before: dict, after: dict, export_dir: str) -> None:
  """The summary's console lines: held-out acceptance (and per draft position, when reported) before
  and after training."""
  third = _third(after)
  print(
      f"held-out acceptance {before['acceptance']:.4f} -> {after['acceptance']:.4f}; {third.replace('_', ' ')} "
      f"{before[third]:.4f} -> {after[third]:.4f}; draft exported to {export_dir}", flush=True)
  for name in ("acceptance_at", "greedy_agreement_at"):
    if name in after:
      print(
          f"held-out {name.removesuffix('_at').replace('_', ' ')} per draft position: " +
          ", ".join(f"{i + 1}: {b:.4f} -> {a:.4f}" for i, (b, a) in enumerate(zip(before[name], after[name]))),
          flush=True)
