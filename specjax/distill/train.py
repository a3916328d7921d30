"""The distillation run: `run(config)` trains a draft toward the target and reports acceptance before/after.

Everything that defines the run lives in the config (see configs/distill_tiny.py for every field). The
work directory holds:
  checkpoints/<step>/   orbax checkpoints (train state: float32 master params and moments; data position;
                        checksums); rerunning resumes the newest that verifies (damaged newer ones are
                        set aside as <step>.damaged, or the run refuses: config.on_damaged_checkpoint)
  metrics.jsonl         one JSON record per train step ("split": "train") and per evaluation ("eval")
  tensorboard/          the same records as TensorBoard scalars (config.tensorboard, needs tensorboardX)
  summary.json          target, student, steps, held-out metrics before and after, wall time
  head_vocab.npy        an EAGLE head's restricted vocabulary (student.draft_vocab > 0): the Vd token ids
                        [Vd] int32 it trains and exports over, ranked once from the training rows
  export/               the distilled draft (its master params rounded to the model dtype: the draft that
                        was evaluated) as a Hugging Face directory (or config.export_dir); an EAGLE head
                        (student.init = "eagle_head") in specjax's head layout (`speculative.eagle_io`),
                        for `--config.drafter=eagle --config.draft=<export dir>`, a DFlash head
                        ("dflash_head") likewise, with its mask embedding, for `--config.drafter=dflash`
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
import functools
import json
import math
import os
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np

from specjax import corpus, draft_vocab, mesh as meshes, partitioning
from specjax.errors import ConfigError
from specjax.distill import data, dflash_steps, eagle_steps, losses, pard, steps, student, tensorboard
from specjax.distill.checkpoint import Checkpointer
from specjax.distill.export import export_hf
from specjax.models.config import ModelConfig
from specjax.models import vocab_map
from specjax.models.load import LoadedModel, load_model
from specjax.models.transformer import Params
from specjax.sampling import sampling_params
from specjax.speculative.drafters.draft_head import DraftHead, restrict_head
from specjax.speculative.drafters.eagle_head import EagleConfig
from specjax.speculative.drafters.eagle_io import save_head
from specjax.speculative.drafters.parallel import save_mask_token

METRICS_FILE, SUMMARY_FILE, CHECKPOINT_DIR = "metrics.jsonl", "summary.json", "checkpoints"
HEAD_VOCAB_FILE = "head_vocab.npy"
ON_DAMAGED_CHECKPOINT = ("fallback", "refuse")  # config.on_damaged_checkpoint's values


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


def check_config(config: ml_collections.ConfigDict) -> None:
  """Fails fast, with the field's name, on settings that would otherwise fail deep inside a run."""
  if not config.target:
    raise ConfigError("config.target is empty: pass --config.target=NAME_OR_PATH (the teacher model)")
  try:
    losses.check_divergence(config.loss.divergence, config.loss.beta)
    if config.tensorboard:
      tensorboard.require()
  except (ValueError, ImportError) as e:
    raise ConfigError(f"config.loss: {e}" if isinstance(e, ValueError) else str(e)) from None
  if not config.loss.temperature > 0:
    raise ConfigError(f"loss.temperature must be > 0, got {config.loss.temperature}")
  if config.student.init not in student.INITS:
    raise ConfigError(f"unknown student.init {config.student.init!r}; expected one of {student.INITS}")
  if config.on_damaged_checkpoint not in ON_DAMAGED_CHECKPOINT:
    raise ConfigError(f"unknown on_damaged_checkpoint {config.on_damaged_checkpoint!r}; expected one of "
                      f"{ON_DAMAGED_CHECKPOINT}")
  for name in ("num_steps", "eval_every", "checkpoint_every", "eval_batches", "log_every"):
    if config[name] < 1:
      raise ConfigError(f"config.{name} must be >= 1, got {config[name]}")
  if config.mesh_indivisible not in partitioning.INDIVISIBLE:
    raise ConfigError(f"config.mesh_indivisible must be one of {partitioning.INDIVISIBLE}, got "
                      f"{config.mesh_indivisible!r}")
  batch, accum = config.data.batch_size, config.accum_steps
  if batch < 1 or accum < 1:
    raise ConfigError(f"config.data.batch_size and config.accum_steps must be >= 1, got {batch} and {accum}")
  if batch % accum:
    raise ConfigError(f"config.accum_steps {accum} does not divide config.data.batch_size {batch}: a step "
                      "splits its batch into accum_steps micro-batches of equal size")
  try:
    data_axis = meshes.axis_sizes(config.mesh, jax.device_count())[0] if config.mesh.strip() else 1
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  if (batch // accum) % data_axis:
    raise ConfigError(f"config.data.batch_size {batch} / accum_steps {accum} = {batch // accum} rows per "
                      f"micro-batch do not split over the mesh's data axis of size {data_axis}: use a batch "
                      f"size that is a multiple of accum_steps x {data_axis} = {accum * data_axis}")
  if config.student.init in student.HEAD_INITS and (config.mesh.strip() or accum > 1 or config.remat
                                                    or config.data.modes.student > 0):
    raise ConfigError(f"student.init {config.student.init!r} trains on one device, without accum_steps, remat or "
                      "the 'student' data mode (a head generates nothing alone): set mesh='', accum_steps=1, "
                      "remat=False, data.modes.student=0")
  if config.student.init == "dflash_head" and (config.student.dflash_block < 1 or config.student.dflash_anchors < 1
                                               or not config.student.dflash_gamma > 0):
    raise ConfigError(f"student.init 'dflash_head' needs student.dflash_block >= 1 (got "
                      f"{config.student.dflash_block}), student.dflash_anchors >= 1 (got "
                      f"{config.student.dflash_anchors}) and student.dflash_gamma > 0 (got {config.student.dflash_gamma})")
  if config.student.draft_vocab and (config.student.init != "eagle_head" or config.student.draft_vocab < 0):
    raise ConfigError(f"config.student.draft_vocab {config.student.draft_vocab}: a restricted vocabulary is "
                      "for student.init 'eagle_head' only, and a count Vd > 0 of tokens (0 = the full vocabulary)")
  if config.student.feature_loss_weight and not (config.student.init == "eagle_head"
                                                 and config.student.feature_layers == "last"):
    raise ConfigError("student.feature_loss_weight (EAGLE-1's feature regression) needs student.init "
                      "'eagle_head' with student.feature_layers 'last'")
  if config.student.init == "parallel" and (config.data.modes.student > 0 or config.student.parallel_k < 2
                                           or not 0.0 < config.student.cod_keep <= 1.0):
    raise ConfigError(f"student.init 'parallel' needs student.parallel_k >= 2 (got {config.student.parallel_k}), "
                      f"student.cod_keep in (0, 1] (got {config.student.cod_keep}) and data.modes.student = 0 (its "
                      "draft proposes blocks: it generates no rows)")
  generates = config.data.modes.target > 0 or config.data.modes.student > 0
  if generates and not 1 <= config.data.prompt_len < config.data.seq_len:
    raise ConfigError(f"data.prompt_len must be in [1, data.seq_len) = [1, {config.data.seq_len}) when a "
                      f"generated mode has weight, got {config.data.prompt_len}")


def init_student(config: ml_collections.ConfigDict, teacher: LoadedModel,
                 part: partitioning.Partitioning | None = None) -> tuple[ModelConfig, Params]:
  """The draft's config and initial params (per-layer layout), per `config.student.init` (see
  `specjax.distill.student`); laid out by `part` when given (a checkpoint loads straight into it)."""
  spec = config.student
  if spec.init in student.HEAD_INITS:
    return student.eagle_head(teacher.config, spec, jax.random.key(config.seed + 1))
  if spec.init == "parallel":  # PARD: the checkpoint, else the truncated target, with a mask token appended
    student_config, params = _draft_model(config, "checkpoint" if spec.checkpoint else "truncate", teacher, part)
    student_config, params = pard.with_mask_row(student_config, params)
    return student_config, partitioning.shard_params(student_config, params, part)
  return _draft_model(config, spec.init, teacher, part)


def _draft_model(config: ml_collections.ConfigDict, init: str, teacher: LoadedModel,
                 part: partitioning.Partitioning | None) -> tuple[ModelConfig, Params]:
  """A draft model initialised as `init` says: "truncate", "fresh" or "checkpoint"."""
  spec = config.student
  if init == "truncate":
    student_config, params = student.truncate(teacher.config, teacher.params, spec.num_layers)
    return student_config, partitioning.shard_params(student_config, params, part)
  if init == "fresh":
    student_config, params = student.fresh(teacher.config, spec, jax.random.key(config.seed + 1))
    return student_config, partitioning.shard_params(student_config, params, part)
  draft = load_model(spec.checkpoint, config.dtype, part)
  student.check_vocab(draft.config, teacher.config, f"student {spec.checkpoint}")
  if draft.tokenizer.fingerprint() != teacher.tokenizer.fingerprint():
    raise ValueError(f"student {spec.checkpoint} has a different tokenizer than the target {teacher.name}")
  return draft.config, student.per_layer(draft.params)


def _labels(config: ml_collections.ConfigDict, student_config, student_params: Params) -> Any:
  """TRAIN / FROZEN per student parameter (`student.frozen_labels`); a head trains whole."""
  if config.student.init in student.HEAD_INITS:
    return jax.tree.map(lambda _: student.TRAIN, student_params)
  return student.frozen_labels(student_config, student_params, config.student.freeze_embeddings,
                               config.student.freeze_head, tuple(config.student.freeze_layers))


def _parts(config: ml_collections.ConfigDict) -> tuple[partitioning.Partitioning | None, ...]:
  """(teacher's, student state's, student forward's) partitionings on `config.mesh`; Nones for one
  device."""
  mesh = meshes.make_mesh(config.mesh)
  if mesh is None:
    return None, None, None
  teacher = partitioning.Partitioning(mesh, partitioning.DECODE_RULES, config.mesh_indivisible, "target")
  state = partitioning.Partitioning(mesh, partitioning.FSDP_RULES, config.mesh_indivisible, "student")
  return teacher, state, dataclasses.replace(teacher, name="student")


def initial_state(config: ml_collections.ConfigDict, student_config: ModelConfig, student_params: Params,
                  optimizer, teacher_params: Params, parts: tuple) -> tuple[steps.TrainState, Any]:
  """(step-0 train state, its `steps.Placement` or None): on a mesh, the state is built in its shards."""
  _, state_part, compute_part = parts
  if state_part is None:
    return steps.init_state(student_params, optimizer, config.seed), None
  shapes = jax.eval_shape(lambda p: steps.init_state(p, optimizer, config.seed), student_params)
  place = steps.placement(student_config, shapes, teacher_params, state_part, compute_part)
  return steps.init_state(student_params, optimizer, config.seed, place.state), place


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
  totals = [meshes.to_host(eval_step(student_params, teacher_params, steps.put_rows(t, place),
                                     steps.put_rows(m, place))) for t, m in batches]
  summed = {k: sum(np.asarray(t[k], np.float64) for t in totals) for k in totals[0]}
  count = max(float(summed.pop("tokens")), 1.0)
  means = {k: float(v) / count for k, v in summed.items() if np.ndim(v) == 0}
  count_at = np.maximum(summed.pop("tokens_at", 1.0), 1.0)
  means.update({k: [float(m) for m in v / count_at] for k, v in summed.items() if np.ndim(v) == 1})
  return {**means, "tokens": int(count)}


def layouts(config: ml_collections.ConfigDict, student_config: ModelConfig) -> tuple[pard.PlainLayout, ...]:
  """The nodes a draft model trains at and is evaluated at (`pard`): PARD's mask blocks for student.init
  "parallel" (COD-dropped in training, every anchor in the evaluation), else the rows themselves."""
  if config.student.init != "parallel":
    return pard.PlainLayout(), pard.PlainLayout()
  make = functools.partial(pard.pard_layout, config.data.seq_len, config.student.parallel_k,
                           mask_id=pard.mask_id(student_config), seed=config.seed)
  return make(keep=config.student.cod_keep), make(keep=1.0)


def _check_finite(step: int, metrics: dict, checkpoints: Checkpointer) -> None:
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


def _restore_newest(config: ml_collections.ConfigDict):
  """(teacher, student config, train state, step, partitionings) at the newest good checkpoint of
  `config.workdir`, read-only (safe while the run goes on). Damaged newer checkpoints are skipped with a
  warning (and left in place: the run owns them), or refused per `config.on_damaged_checkpoint`. Raises
  if the workdir has no checkpoint, or only damaged ones."""
  parts = _parts(config)
  teacher = load_model(config.target, config.dtype, parts[0])
  student_config, student_params = init_student(config, teacher, parts[1])
  labels = _labels(config, student_config, student_params)
  optimizer, _ = steps.make_optimizer(config.optim, config.num_steps, labels)
  template, _ = initial_state(config, student_config, student_params, optimizer, teacher.params, parts)
  checkpoints = Checkpointer(os.path.join(config.workdir, CHECKPOINT_DIR), config.keep_checkpoints,
                            read_only=True)
  try:
    restored = checkpoints.restore_newest(template, fallback=config.on_damaged_checkpoint == "fallback")
  finally:
    checkpoints.close()
  if restored is None:
    raise FileNotFoundError(f"no checkpoint in {checkpoints.directory}")
  step, state, _ = restored
  return teacher, student_config, state, step, parts


def latest_student(config: ml_collections.ConfigDict) -> tuple[LoadedModel, LoadedModel, int]:
  """(teacher, draft at the newest good checkpoint of `config.workdir`, its step): for measuring or
  exporting a run that is still going or was stopped (see `_restore_newest`)."""
  if config.student.init in student.HEAD_INITS:
    raise ValueError("latest_student loads draft models; for an EAGLE or DFlash head's run use latest_head")
  teacher, student_config, state, step, parts = _restore_newest(config)
  draft = LoadedModel(f"{teacher.name}-draft-step{step}", student_config,
                      steps.model_params(student_config, state.params), teacher.tokenizer, parts[1])
  return teacher, draft, step


def latest_head(config: ml_collections.ConfigDict
                ) -> tuple[LoadedModel, EagleConfig, Params, DraftHead | None, int]:
  """(teacher, EAGLE head config, its params in the head's dtype, its restricted vocabulary or None,
  step) at the newest good checkpoint of an `eagle_head` or `dflash_head` run (see `_restore_newest`):
  what `save_head` exports."""
  if config.student.init not in student.HEAD_INITS:
    raise ValueError("latest_head loads EAGLE and DFlash heads; for a draft model's run use latest_student")
  teacher, head_config, state, step, _ = _restore_newest(config)
  vocab = None
  if config.student.draft_vocab:
    tokens_Vd = np.load(os.path.join(config.workdir, HEAD_VOCAB_FILE))
    vocab = restrict_head(teacher.config, teacher.params, tokens_Vd)
  return teacher, head_config, eagle_steps.run_params(head_config, state.params), vocab, step


def head_vocab(config: ml_collections.ConfigDict, teacher: LoadedModel, train_rows: data.Packed
               ) -> DraftHead | None:
  """The restricted vocabulary of an EAGLE head's run (`config.student.draft_vocab` tokens most frequent
  in the training rows, stop tokens included), or None for the full one."""
  size = config.student.draft_vocab
  if not size:
    return None
  counts_V = np.bincount(train_rows.tokens[train_rows.mask], minlength=teacher.config.vocab_size)
  try:
    tokens_Vd = draft_vocab.most_frequent(counts_V, size, always=teacher.tokenizer.eos_ids)
  except ValueError as e:
    raise ConfigError(f"config.student.draft_vocab: {e}") from None
  print(f"the head trains over {len(tokens_Vd)} of {teacher.config.vocab_size} tokens, "
        f"{vocab_map.coverage(counts_V, tokens_Vd):.2%} of the training tokens", flush=True)
  return restrict_head(teacher.config, teacher.params, tokens_Vd)


def _keep_head_vocab(workdir: str, vocab: DraftHead | None) -> None:
  """Writes the head's vocabulary into `workdir` (what `latest_head` reads); a resumed run must rank the
  same one (same rows, same size)."""
  if vocab is None:
    return
  path, tokens_Vd = os.path.join(workdir, HEAD_VOCAB_FILE), np.asarray(vocab.tokens_Vd, np.int32)
  if os.path.exists(path) and not np.array_equal(np.load(path), tokens_Vd):
    raise ConfigError(f"{path} holds another restricted vocabulary than config.student.draft_vocab "
                      f"{len(tokens_Vd)} ranks from these training rows: use a new work directory")
  if meshes.is_main_process():
    np.save(path + ".tmp.npy", tokens_Vd)
    os.replace(path + ".tmp.npy", path)


@dataclasses.dataclass
class _Setup:
  """Everything a run needs before its first step, built from the config alone."""

  teacher: LoadedModel
  parts: tuple  # (teacher, student state, student forward) Partitionings; Nones on one device
  student_config: ModelConfig
  student_params: Params
  labels: Any  # TRAIN / FROZEN per student parameter
  stream: data.BatchStream
  batches: data.DistillBatches
  held_batches: list  # [(tokens [B, T], mask [B, T])]
  train_tokens: int
  head_vocab: DraftHead | None  # an EAGLE head's restricted vocabulary (student.draft_vocab)


def _setup(config: ml_collections.ConfigDict) -> _Setup:
  """Reads the data (cheap failures first), loads the teacher (into its shards on a mesh), builds the
  student and the batches."""
  docs = corpus.read_documents(config.data.source, config.data.pattern, config.data.jsonl_field)
  train_docs, held_docs = data.split_documents(docs, config.data.heldout_fraction, config.seed)
  parts = _parts(config)
  teacher = load_model(config.target, config.dtype, parts[0])
  tokenizer = teacher.tokenizer
  if not tokenizer.eos_ids:
    raise ValueError(f"the target {teacher.name}'s tokenizer names no EOS token (needed between documents)")
  student_config, student_params = init_student(config, teacher, parts[1])
  labels = _labels(config, student_config, student_params)
  pack = lambda d, limit: data.pack(d, tokenizer.encode, config.data.seq_len, tokenizer.eos_ids[0], limit)
  train_rows = pack(train_docs, config.data.max_train_tokens)
  stream = data.BatchStream(train_rows, config.data.batch_size, config.seed)
  how = data.Continuation(config.data.prompt_len, tuple(tokenizer.eos_ids), sampling_params(config.data.temperature))
  batches = data.DistillBatches(stream, dict(config.data.modes), config.seed, how, teacher.config, teacher.params,
                                None if config.student.init in (*student.HEAD_INITS, "parallel") else student_config,
                                parts[:2])
  held_batches = _eval_batches(pack(held_docs, config.data.max_heldout_tokens), config.data.batch_size,
                               config.eval_batches)
  return _Setup(teacher, parts, student_config, student_params, labels, stream, batches, held_batches,
                int(train_rows.mask.sum()), head_vocab(config, teacher, train_rows))


class _Log:
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
    _check_finite(step, record, self.checkpoints)
    now = time.time()
    record["tokens_per_s"], self.t_previous = info["tokens"] / max(now - self.t_previous, 1e-9), now
    self._write(record)
    self.on_step(step, record)
    self.tokens_since += info["tokens"]
    if self.main and (step % self.config.log_every == 0 or step == self.config.num_steps):
      rate = self.tokens_since / max(now - self.t_last, 1e-9)
      eta = (self.config.num_steps - step) * (now - self.t_start) / max(step - self.start, 1)
      print(f"step {step:6d}/{self.config.num_steps}  loss {record['loss']:.4f}  grad norm "
            f"{record['grad_norm']:.3f}  lr {record['learning_rate']:.2e}  {rate:,.0f} tok/s  "
            f"eta {eta / 60:.1f} min", flush=True)
      self.t_last, self.tokens_since = now, 0

  def eval(self, step: int, metrics: dict) -> None:
    self._write({"step": step, "split": "eval", **metrics})
    if self.main:
      third = ("greedy agreement", "greedy_agreement") if "greedy_agreement" in metrics else (
          "acceptance length", "acceptance_length")
      print(f"step {step:6d} eval  loss {metrics['loss']:.4f}  acceptance {metrics['acceptance']:.4f}  "
            f"{third[0]} {metrics[third[1]]:.4f}", flush=True)
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
  setup = _setup(config)
  teacher_params = setup.teacher.params
  optimizer, schedule = steps.make_optimizer(config.optim, config.num_steps, setup.labels)
  state, place = initial_state(config, setup.student_config, setup.student_params, optimizer, teacher_params,
                               setup.parts)
  head = config.student.init in student.HEAD_INITS
  if config.student.init == "dflash_head":
    objective = dflash_steps.BlockObjective(config.student.dflash_block, config.student.dflash_anchors,
                                            config.student.dflash_gamma)
    train_step = dflash_steps.make_train_step(setup.student_config, setup.teacher.config, optimizer, schedule,
                                              objective)
    eval_step = dflash_steps.make_eval_step(setup.student_config, setup.teacher.config, objective)
  elif head:
    _keep_head_vocab(workdir, setup.head_vocab)
    train_step = functools.partial(
        eagle_steps.make_train_step(setup.student_config, setup.teacher.config, optimizer, schedule,
                                    config.student.ttt_steps, config.student.feature_loss_weight),
        vocab=setup.head_vocab)
    eval_step = functools.partial(
        eagle_steps.make_eval_step(setup.student_config, setup.teacher.config, config.student.ttt_steps,
                                   config.student.feature_loss_weight), vocab=setup.head_vocab)
  else:
    train_layout, eval_layout = layouts(config, setup.student_config)
    train_step = steps.make_train_step(setup.teacher.config, setup.student_config.replace(remat=config.remat),
                                       steps.Optimizer(optimizer, schedule), setup.labels, config.loss,
                                       config.accum_steps, place, train_layout)
    eval_step = steps.make_eval_step(setup.teacher.config, setup.student_config, config.loss,
                                     config.eval_temperature, place, eval_layout)
  compute_params = functools.partial(eagle_steps.run_params if head else steps.model_params, setup.student_config)

  checkpoints = Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), config.keep_checkpoints, config.keep_every)
  start = 0
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
  log = _Log(workdir, config, start, checkpoints, on_step)
  evaluate = lambda step: log.eval(step, _evaluate(eval_step, state.params, teacher_params, setup.held_batches,
                                                   place))

  try:
    if start == 0 or start % config.eval_every == 0 or start == config.num_steps:
      evaluate(start)
    for step in range(start + 1, config.num_steps + 1):
      gen_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), setup.stream.position)
      tokens_BxT, mask_BxT, mode = setup.batches.next(None if head else compute_params(state.params), gen_key)
      state, device_metrics = train_step(state, teacher_params, steps.put_rows(tokens_BxT, place),
                                         steps.put_rows(mask_BxT, place))
      log.train(step, device_metrics, {"mode": mode, "tokens": int(mask_BxT.sum())})
      if step % config.checkpoint_every == 0 or step == config.num_steps:
        log.flush()
        checkpoints.save(step, state, {"data": setup.stream.state(), "step": step})
      if step % config.eval_every == 0 or step == config.num_steps:
        evaluate(step)
  finally:
    checkpoints.close()  # finishes saves already started: they hold good steps
    log.close()

  export_dir = os.path.abspath(config.export_dir or os.path.join(workdir, "export"))
  draft_params = meshes.to_host(compute_params(state.params))  # every process
  if not meshes.is_main_process():
    return {"export_dir": export_dir}
  if head:
    save_head(export_dir, setup.student_config, draft_params, setup.head_vocab)
  else:
    export_hf(export_dir, setup.student_config, draft_params, setup.teacher.tokenizer)
    if config.student.init == "parallel":
      save_mask_token(export_dir, pard.mask_id(setup.student_config))
  before, after = _first_and_last_eval(log.path)
  summary = {
      "target": setup.teacher.name, "student": dataclasses.asdict(setup.student_config),
      "init": config.student.init, "divergence": config.loss.divergence, "num_steps": config.num_steps,
      "train_tokens_available": setup.train_tokens, "devices": meshes.describe(place and place.mesh), "heldout_tokens": after["tokens"],
      "before": before, "after": after, "acceptance_gain": after["acceptance"] - before["acceptance"],
      "export_dir": export_dir, "wall_s_this_run": time.time() - log.t_start,
  }
  with open(os.path.join(workdir, SUMMARY_FILE), "w") as f:
    json.dump(summary, f, indent=2)
  third = "greedy_agreement" if "greedy_agreement" in after else "acceptance_length"
  print(f"held-out acceptance {before['acceptance']:.4f} -> {after['acceptance']:.4f}; {third.replace('_', ' ')} "
        f"{before[third]:.4f} -> {after[third]:.4f}; draft exported to {export_dir}", flush=True)
  for name in ("acceptance_at", "greedy_agreement_at"):
    if name in after:
      print(f"held-out {name.removesuffix('_at').replace('_', ' ')} per draft position: " + ", ".join(
          f"{i + 1}: {b:.4f} -> {a:.4f}" for i, (b, a) in enumerate(zip(before[name], after[name]))), flush=True)
  return summary


def _first_and_last_eval(metrics_path: str) -> tuple[dict, dict]:
  with open(metrics_path) as f:
    evals = [r for line in f if (r := json.loads(line))["split"] == "eval"]
  return evals[0], evals[-1]
