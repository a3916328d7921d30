"""The distillation run: `run(config)` trains a draft toward the target and reports acceptance before/after.

Everything that defines the run lives in the config (see configs/distill_tiny.py for every field); what
the draft is and how it trains is its objective (`config.student.init`, `specjax.distill.objective`).
The work directory holds:
  checkpoints/<step>/   orbax checkpoints (train state: float32 master params and moments; data position;
                        checksums); rerunning resumes the newest that verifies (damaged newer ones are
                        set aside as <step>.damaged, or the run refuses: config.on_damaged_checkpoint)
  metrics.jsonl         one JSON record per train step ("split": "train") and per evaluation ("eval")
  tensorboard/          the same records as TensorBoard scalars (config.tensorboard, needs tensorboardX)
  summary.json          target, student, steps, held-out metrics before and after, wall time
  export/               the distilled draft (its master params as the draft runs them: the draft that was
                        evaluated) as its objective exports it (or config.export_dir): a Hugging Face
                        directory for a draft model, specjax's head layout for an EAGLE or DFlash head
and whatever the objective keeps there (an EAGLE head's restricted vocabulary, head_vocab.npy).
Killing the process at any moment and rerunning the same command continues from the last checkpoint
and ends with exactly the parameters of an uninterrupted run: batch i, its generation mode and its
sampling key are pure functions of (seed, i), and the state carries everything else.

On a device mesh (`config.mesh`, see `specjax.distill.steps` for the layout) the teacher loads straight
into its shards, the state is born sharded, and checkpoints save and restore the shards (orbax): a run
resumes bit for bit on the same mesh, and onto another mesh shape (or one device) with the saved
values laid out by the new mesh (its steps then add sums in another order: equal up to float rounding).
In a multi-process run (`specjax.mesh.initialize_distributed`) every process runs this same function
on identical host batches and takes part in checkpoint saves and in the gathers of metrics and of the
exported draft; only process 0 writes metrics.jsonl, TensorBoard, summary.json and the export.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np

from specjax import corpus, mesh as meshes, partitioning
from specjax.distill import data, objective, steps
from specjax.distill.checkpoint import Checkpointer
from specjax.distill.config import check_fields
from specjax.distill.log import Log, print_before_and_after
from specjax.models.load import LoadedModel, load_model
from specjax.models.transformer import Params
from specjax.sampling import sampling_params

SUMMARY_FILE, CHECKPOINT_DIR = "summary.json", "checkpoints"


def prepare_workdir(workdir: str) -> str:
  """Creates `workdir` and proves it writable before any expensive work; returns its absolute path."""
  if not workdir:
    raise ValueError("config.workdir is empty: pass --config.workdir=DIR")
  path = os.path.abspath(workdir)
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
      pass
  except OSError as e:
    raise PermissionError(f"workdir {path} cannot be created or written: {e}") from e
  return path


def check_config(config: ml_collections.ConfigDict) -> type[objective.Objective]:
  """Fails fast, with the field's name, on settings that would otherwise fail deep inside a run: the run's
  own (`config.check_fields`), then the objective's (`objective.check`); returns the objective's class."""
  check_fields(config)
  return objective.check(config)


def init_student(config: ml_collections.ConfigDict, teacher: LoadedModel,
                 part: partitioning.Partitioning | None = None) -> tuple[Any, Params]:
  """The draft's config and initial params (per-layer layout) as its objective starts it (`Objective.init`);
  laid out by `part` when given (a checkpoint loads straight into it)."""
  return objective.resolve(config.student.init)(config).init(teacher, part)


def _parts(config: ml_collections.ConfigDict) -> tuple[partitioning.Partitioning | None, ...]:
  """(teacher's, student state's, student forward's) partitionings on `config.mesh`; Nones for one
  device."""
  mesh = meshes.make_mesh(config.mesh)
  if mesh is None:
    return None, None, None
  teacher = partitioning.Partitioning(mesh, partitioning.DECODE_RULES, config.mesh_indivisible, "target")
  state = partitioning.Partitioning(mesh, partitioning.FSDP_RULES, config.mesh_indivisible, "student")
  return teacher, state, dataclasses.replace(teacher, name="student")


def initial_state(config: ml_collections.ConfigDict, student_config: Any, student_params: Params, optimizer,
                  teacher_params: Params, parts: tuple) -> tuple[steps.TrainState, Any]:
  """(step-0 train state, its `steps.Placement` or None): on a mesh, the state is built in its shards."""
  _, state_part, compute_part = parts
  if state_part is None:
    return steps.init_state(student_params, optimizer, config.seed), None
  shapes = jax.eval_shape(lambda p: steps.init_state(p, optimizer, config.seed), student_params)
  place = steps.placement(student_config, shapes, teacher_params, state_part, compute_part)
  return steps.init_state(student_params, optimizer, config.seed, place.state), place


@dataclasses.dataclass
class _Student:
  """The objective's student at step 0, with what its steps are built from."""

  objective: objective.Objective
  config: Any  # the student's config (`Objective.init`)
  state: steps.TrainState  # step 0's
  place: steps.Placement | None
  context: objective.StepContext


def _student(config: ml_collections.ConfigDict, teacher: LoadedModel, parts: tuple) -> _Student:
  """The objective's student, its labels, optimizer and step-0 state (in its shards on a mesh)."""
  trainer = objective.resolve(config.student.init)(config)
  student_config, params = trainer.init(teacher, parts[1])
  labels = trainer.labels(student_config, params)
  optimizer = steps.make_optimizer(config.optim, config.num_steps, labels)
  state, place = initial_state(config, student_config, params, optimizer.transform, teacher.params, parts)
  return _Student(trainer, student_config, state, place,
                  objective.StepContext(teacher.config, student_config, labels, optimizer, place))


def _restore_newest(config: ml_collections.ConfigDict) -> tuple[LoadedModel, _Student, steps.TrainState, int, tuple]:
  """(teacher, student, train state, step, partitionings) at the newest good checkpoint of `config.workdir`,
  read-only (safe while the run goes on). Damaged newer checkpoints are skipped with a warning (and left
  in place: the run owns them), or refused per `config.on_damaged_checkpoint`. Raises if the workdir has
  no checkpoint, or only damaged ones."""
  parts = _parts(config)
  teacher = load_model(config.target, config.dtype, parts[0])
  student = _student(config, teacher, parts)
  checkpoints = Checkpointer(os.path.join(config.workdir, CHECKPOINT_DIR), config.keep_checkpoints, read_only=True)
  try:
    restored = checkpoints.restore_newest(student.state, fallback=config.on_damaged_checkpoint == "fallback")
  finally:
    checkpoints.close()
  if restored is None:
    raise FileNotFoundError(f"no checkpoint in {checkpoints.directory}")
  step, state, _ = restored
  return teacher, student, state, step, parts


def latest(config: ml_collections.ConfigDict) -> tuple:
  """The draft at the newest good checkpoint of `config.workdir` (see `_restore_newest`), as its objective
  gives it (`Objective.latest`): (teacher, draft model, step) for a draft model's run, (teacher, head
  config, params, restricted vocabulary or None, step) for a head's. For measuring or exporting a run
  that is still going or was stopped."""
  teacher, student, state, step, parts = _restore_newest(config)
  return student.objective.latest(teacher, student.config, state.params, step, parts[1])


def _eval_batches(held: data.Packed, batch_size: int, num_batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """The first `num_batches` batches of held-out rows in file order; the last one padded with masked rows."""
  tokens, mask = held.tokens[:batch_size * num_batches], held.mask[:batch_size * num_batches]
  pad = -len(tokens) % batch_size
  tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), tokens.dtype)])
  mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), bool)])
  return [(tokens[i:i + batch_size], mask[i:i + batch_size]) for i in range(0, len(tokens), batch_size)]


def _evaluate(eval_step: Callable, student_params: Params, teacher_params: Params,
              batches: Sequence[tuple[np.ndarray, np.ndarray]], place: steps.Placement | None = None) -> dict:
  """The held-out means; per draft position too (lists, "acceptance_at", ...) when the eval step sums them."""
  totals = [
      meshes.to_host(eval_step(student_params, teacher_params, steps.put_rows(t, place), steps.put_rows(m, place)))
      for t, m in batches
  ]
  summed = {k: sum(np.asarray(t[k], np.float64) for t in totals) for k in totals[0]}
  count = max(float(summed.pop("tokens")), 1.0)
  means = {k: float(v) / count for k, v in summed.items() if np.ndim(v) == 0}
  count_at = np.maximum(summed.pop("tokens_at", 1.0), 1.0)
  means.update({k: [float(m) for m in v / count_at] for k, v in summed.items() if np.ndim(v) == 1})
  return {**means, "tokens": int(count)}


@dataclasses.dataclass
class _Setup:
  """Everything a run needs before its first step, built from the config alone."""

  teacher: LoadedModel
  student: _Student
  steps: objective.Steps
  stream: data.BatchStream
  batches: data.DistillBatches
  held_batches: list  # [(tokens [B, T], mask [B, T])]
  train_tokens: int


def _setup(config: ml_collections.ConfigDict, workdir: str) -> _Setup:
  """Reads the data (cheap failures first), loads the teacher (into its shards on a mesh), builds the
  student, its steps and the batches."""
  docs = corpus.read_documents(config.data.source, config.data.pattern, config.data.jsonl_field)
  train_docs, held_docs = data.split_documents(docs, config.data.heldout_fraction, config.seed)
  parts = _parts(config)
  teacher = load_model(config.target, config.dtype, parts[0])
  tokenizer = teacher.tokenizer
  if not tokenizer.eos_ids:
    raise ValueError(f"the target {teacher.name}'s tokenizer names no EOS token (needed between documents)")
  student = _student(config, teacher, parts)
  pack = lambda d, limit: data.pack(d, tokenizer.encode, config.data.seq_len, tokenizer.eos_ids[0], limit)
  train_rows = pack(train_docs, config.data.max_train_tokens)
  stream = data.BatchStream(train_rows, config.data.batch_size, config.seed)
  how = data.Continuation(config.data.prompt_len, tuple(tokenizer.eos_ids), sampling_params(config.data.temperature))
  batches = data.DistillBatches(stream, dict(config.data.modes), config.seed, how, teacher.config, teacher.params,
                                student.config if student.objective.generates else None, parts[:2])
  held_batches = _eval_batches(pack(held_docs, config.data.max_heldout_tokens), config.data.batch_size,
                               config.eval_batches)
  student.objective.prepare(workdir, teacher, train_rows)
  return _Setup(teacher, student, student.objective.steps(student.context), stream, batches, held_batches,
                int(train_rows.mask.sum()))


def run(config: ml_collections.ConfigDict, on_step: Callable[[int, dict], None] = lambda step, m: None) -> dict:
  """Runs (or resumes) the distillation described by `config`, exports the draft, and returns the
  summary it also writes. `on_step(step, metrics)` sees each step's fetched metrics (a progress hook;
  the tests use it to interrupt a run).

  It resumes from the newest checkpoint that restores and matches its checksums. Damaged newer ones are
  reported by step and path and set aside as `<step>.damaged` (config.on_damaged_checkpoint="fallback"),
  or stop the run with a `CorruptCheckpointError` ("refuse"). If checkpoints exist but every one is
  damaged, the run raises instead of silently restarting from step 0."""
  check_config(config)
  workdir = prepare_workdir(config.workdir)
  setup = _setup(config, workdir)
  checkpoints = Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), config.keep_checkpoints, config.keep_every)
  start, state = 0, setup.student.state
  try:
    restored = checkpoints.restore_newest(state, fallback=config.on_damaged_checkpoint == "fallback")
    if restored:
      start, state, meta = restored
      setup.stream.restore(meta["data"])
  except BaseException:
    checkpoints.close()  # nothing is being saved yet
    raise
  if start and meshes.is_main_process():
    print(f"resuming from step {start} ({checkpoints.step_path(start)})", flush=True)
  log = Log(workdir, config, start, checkpoints, on_step)
  try:
    state = _train(config, setup, state, start, log, checkpoints)
  finally:
    checkpoints.close()  # finishes saves already started: they hold good steps
    log.close()
  return _export(config, workdir, setup, state, log)


def _train(config: ml_collections.ConfigDict, setup: _Setup, state: steps.TrainState, start: int, log: Log,
           checkpoints: Checkpointer) -> steps.TrainState:
  """Steps `start` + 1 .. num_steps, with their checkpoints and evaluations; the final state."""
  teacher_params, student, place = setup.teacher.params, setup.student, setup.student.place
  evaluate = lambda step: log.eval(step,
                                   _evaluate(setup.steps.eval, state.params, teacher_params, setup.held_batches, place))
  if start == 0 or start % config.eval_every == 0 or start == config.num_steps:
    evaluate(start)
  for step in range(start + 1, config.num_steps + 1):
    gen_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), setup.stream.position)
    policy = student.objective.run_params(student.config, state.params) if student.objective.generates else None
    tokens_BxT, mask_BxT, mode = setup.batches.next(policy, gen_key)
    state, device_metrics = setup.steps.train(state, teacher_params, steps.put_rows(tokens_BxT, place),
                                              steps.put_rows(mask_BxT, place))
    log.train(step, device_metrics, {"mode": mode, "tokens": int(mask_BxT.sum())})
    if step % config.checkpoint_every == 0 or step == config.num_steps:
      log.flush()
      checkpoints.save(step, state, {"data": setup.stream.state(), "step": step})
    if step % config.eval_every == 0 or step == config.num_steps:
      evaluate(step)
  return state


def _export(config: ml_collections.ConfigDict, workdir: str, setup: _Setup, state: steps.TrainState, log: Log) -> dict:
  """Exports the draft as its objective does, then writes and prints the summary (process 0)."""
  student = setup.student
  export_dir = os.path.abspath(config.export_dir or os.path.join(workdir, "export"))
  draft_params = meshes.to_host(student.objective.run_params(student.config, state.params))  # every process
  if not meshes.is_main_process():
    return {"export_dir": export_dir}
  student.objective.export(export_dir, student.config, draft_params, setup.teacher)
  before, after = log.first_and_last_eval()
  summary = {
      "target": setup.teacher.name,
      "student": dataclasses.asdict(student.config),
      "init": config.student.init,
      "divergence": config.loss.divergence,
      "num_steps": config.num_steps,
      "train_tokens_available": setup.train_tokens,
      "devices": meshes.describe(student.place and student.place.mesh),
      "heldout_tokens": after["tokens"],
      "before": before,
      "after": after,
      "acceptance_gain": after["acceptance"] - before["acceptance"],
      "export_dir": export_dir,
      "wall_s_this_run": time.time() - log.t_start,
  }
  with open(os.path.join(workdir, SUMMARY_FILE), "w") as f:
    json.dump(summary, f, indent=2)
  print_before_and_after(before, after, export_dir)
  return summary
