"""Every setting of a distillation run, with its default and meaning (configs/distill_*.py override it),
and the checks of the run's own settings (`check_fields`; the student's are its objective's).

No field is `None`: placeholders are typed ("" for paths the command line must give), so
`--config.FIELD=VALUE` overrides parse and `lock_config` rejects misspelt fields.
"""

from __future__ import annotations

import jax
import ml_collections

from specjax import mesh as meshes, partitioning
from specjax.distill import losses, tensorboard
from specjax.errors import ConfigError

ON_DAMAGED_CHECKPOINT = ("fallback", "refuse")  # config.on_damaged_checkpoint's values


def default_config() -> ml_collections.ConfigDict:
  """The run's fields, then its groups: `student`, `data`, `loss`, `optim`, and the loop's fields."""
  c = ml_collections.ConfigDict()
  c.workdir = ""  # checkpoints, metrics.jsonl, summary.json and the export go here (required)
  c.seed = 0  # data split and order, generation modes, sampling keys, fresh-student init
  c.target = ""  # the teacher: an HF directory, GGUF file, registry name or hub name org/name (models.load)
  c.dtype = "float32"  # compute dtype of both models ("bfloat16" on GPU/TPU); the student trains a float32 master
  c.mesh = ""  # device mesh "data=2,model=4" ("" = one device; -1 = the remaining devices): rows on data, the
  #              student and its Adam moments FSDP (model by tensor-parallel rules + residual width on data),
  #              the teacher tensor-parallel over model as a decode target
  c.mesh_indivisible = "error"  # heads/MLP/vocabulary/width that do not split over their mesh axis: "error" or
  #                               "replicate" (kept whole on every device: more memory, same numbers)
  c.accum_steps = 1  # gradient accumulation: each step's batch runs as this many micro-batches (dividing
  #                    data.batch_size; each micro-batch's rows must split over the mesh's data axis), one update
  c.remat = False  # rematerialise each student block in the backward (jax.checkpoint): less memory, more compute
  c.student, c.data, c.loss, c.optim = _student(), _data(), _loss(), _optim()
  c.num_steps = 1000  # optimizer steps of the whole run (a resumed run continues to it)
  c.log_every = 10  # console progress every this many steps (every step goes to metrics.jsonl)
  c.eval_every = 100  # held-out evaluation every this many steps (and before the first, after the last)
  c.eval_batches = 8  # held-out batches per evaluation (fixed rows, in order)
  c.tensorboard = False  # also write the metrics as TensorBoard scalars to WORKDIR/tensorboard (tensorboardX)
  c.eval_temperature = 1.0  # temperature of the expected-acceptance metric sum_x min(p, q)
  c.checkpoint_every = 100  # save a checkpoint every this many steps (and after the last)
  c.keep_checkpoints = 2  # newest checkpoints kept
  c.keep_every = 0  # also keep every checkpoint whose step is a multiple of this (0 = none)
  c.on_damaged_checkpoint = "fallback"  # unreadable/mismatching checkpoint: "fallback" (warn, resume) or "refuse"
  c.export_dir = ""  # where the HF-format draft is written at the end ("" = WORKDIR/export)
  return c


def _student() -> ml_collections.ConfigDict:
  """config.student: the draft and the objective that trains it (`specjax.distill.objective`)."""
  g = ml_collections.ConfigDict()
  g.init = "truncate"  # the objective that trains the draft (`specjax.distill.objectives`): "truncate" (the
  #                     target's first layers), "checkpoint", "fresh", "parallel" (PARD: student.checkpoint, else
  #                     the truncated target, with a mask token), "eagle_head" or "dflash_head" (a DFlash block head)
  g.num_layers = 2  # truncate: how many of the target's first blocks the draft keeps
  g.checkpoint = ""  # checkpoint: the draft to start from (same vocabulary and tokenizer)
  g.d_model = 64  # fresh: width of the residual stream
  g.n_layers = 2  # fresh: number of blocks
  g.n_heads = 4  # fresh: query heads
  g.n_kv_heads = 2  # fresh: key/value heads
  g.head_dim = 16  # fresh: width of one head
  g.d_ff = 128  # fresh: MLP hidden width
  g.tie_embeddings = True  # fresh: output head shares the embedding matrix
  g.freeze_embeddings = False  # keep the token (and position) embeddings fixed
  g.freeze_head = False  # keep the output head fixed (a tied head is the embedding)
  g.freeze_layers = ()  # indices of draft blocks kept fixed, e.g. (0, 1)
  g.feature_layers = "eagle3"  # eagle_head, dflash_head: target features read: "eagle3" (low, middle, high
  #                              blocks), "last" (EAGLE-1: the final-norm hidden state) or "1,5,9"
  g.ttt_steps = 7  # eagle_head: drafting steps unrolled by the training-time test (loss 0.8^j)
  g.draft_vocab = 0  # eagle_head: train (and export) the head over the Vd tokens most frequent in the
  #                    training rows (stop tokens included), EAGLE-3's draft vocabulary: a Vd-column
  #                    output projection, V / Vd times cheaper (0 = the full vocabulary)
  g.parallel_k = 4  # parallel: K, the draft tokens one pass proposes (masks per block: K - 1)
  g.cod_keep = 0.7  # parallel: conditional drop, masks of depth j below this ^ j of the anchors (1 = all)
  g.dflash_block = 4  # dflash_head: K, the block one pass fills ([anchor token, MASK x (K - 1)])
  g.dflash_anchors = 8  # dflash_head: random anchors (blocks) trained per row and step
  g.dflash_gamma = 4.0  # dflash_head: block slot j's loss weighted exp(-j / gamma) (DFlash's decay)
  g.feature_loss_weight = 0.0  # eagle_head, feature_layers "last": weight of EAGLE-1's smooth-L1
  #                              regression of the head's output on the target's next hidden state
  return g


def _data() -> ml_collections.ConfigDict:
  """config.data: the training and held-out rows and how they are generated."""
  g = ml_collections.ConfigDict()
  g.source = "stdlib"  # "stdlib", a directory, a glob, a .jsonl file or a text file
  g.pattern = "**/*.py"  # files matched below a directory source
  g.jsonl_field = "text"  # the string field of each JSONL record
  g.heldout_fraction = 0.05  # documents held out for evaluation (split by document)
  g.max_train_tokens = 0  # cap on the tokenized training stream (0 = all of it)
  g.max_heldout_tokens = 0  # cap on the tokenized held-out stream (0 = all of it)
  g.seq_len = 128  # tokens per training row (packed across documents)
  g.batch_size = 8  # rows per step
  g.modes = ml_collections.ConfigDict({"fixed": 1.0, "target": 0.0, "student": 0.0})  # mixing weights
  g.prompt_len = 32  # generated modes: tokens of each row kept as the prompt, the rest is generated
  g.temperature = 1.0  # generated modes: sampling temperature of the continuations (0 = greedy)
  return g


def _loss() -> ml_collections.ConfigDict:
  """config.loss: the divergence a draft model is trained by."""
  g = ml_collections.ConfigDict()
  g.divergence = "forward_kl"  # "forward_kl" KL(q||p), "reverse_kl" KL(p||q), "jsd", "tvd"
  g.temperature = 1.0  # both models' logits are divided by it before the divergence
  g.beta = 0.5  # jsd: the teacher's weight in the mixture m = beta q + (1 - beta) p
  return g


def _optim() -> ml_collections.ConfigDict:
  """config.optim: AdamW on a warmup-cosine schedule."""
  g = ml_collections.ConfigDict()
  g.learning_rate = 3e-4  # peak learning rate of AdamW
  g.warmup_steps = 100  # linear warmup from 0 to the peak
  g.final_lr_fraction = 0.1  # cosine decay ends at this fraction of the peak
  g.weight_decay = 0.01  # decoupled weight decay (matrices only)
  g.b1 = 0.9  # Adam first-moment decay
  g.b2 = 0.95  # Adam second-moment decay
  g.grad_clip = 1.0  # clip the global gradient norm to this (0 = no clipping)
  return g


def check_fields(config: ml_collections.ConfigDict) -> None:
  """Fails fast, with the field's name, on run settings (every objective's) that would otherwise fail
  deep inside a run; `objective.check` checks the student's."""
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
  if config.on_damaged_checkpoint not in ON_DAMAGED_CHECKPOINT:
    raise ConfigError(f"unknown on_damaged_checkpoint {config.on_damaged_checkpoint!r}; expected one of "
                      f"{ON_DAMAGED_CHECKPOINT}")
  for name in ("num_steps", "eval_every", "checkpoint_every", "eval_batches", "log_every"):
    if config[name] < 1:
      raise ConfigError(f"config.{name} must be >= 1, got {config[name]}")
  _check_batches(config)
  generates = config.data.modes.target > 0 or config.data.modes.student > 0
  if generates and not 1 <= config.data.prompt_len < config.data.seq_len:
    raise ConfigError(f"data.prompt_len must be in [1, data.seq_len) = [1, {config.data.seq_len}) when a "
                      f"generated mode has weight, got {config.data.prompt_len}")


def _check_batches(config: ml_collections.ConfigDict) -> None:
  """The batch splits into `accum_steps` micro-batches whose rows split over the mesh's data axis."""
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
