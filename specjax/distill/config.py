"""Every setting of a distillation run, with its default and meaning; configs/distill_*.py override it.

No field is `None`: placeholders are typed ("" for paths the command line must give), so
`--config.FIELD=VALUE` overrides parse and `lock_config` rejects misspelt fields.
"""

from __future__ import annotations

import ml_collections


def default_config() -> ml_collections.ConfigDict:
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

  c.student = ml_collections.ConfigDict()
  c.student.init = "truncate"  # "truncate" (target's first layers), "checkpoint", "fresh", "eagle_head",
  #                               "dflash_head" (a DFlash block head) or "parallel" (PARD: student.checkpoint, else
  #                               the truncated target, with a mask token)
  c.student.num_layers = 2  # truncate: how many of the target's first blocks the draft keeps
  c.student.checkpoint = ""  # checkpoint: the draft to start from (same vocabulary and tokenizer)
  c.student.d_model = 64  # fresh: width of the residual stream
  c.student.n_layers = 2  # fresh: number of blocks
  c.student.n_heads = 4  # fresh: query heads
  c.student.n_kv_heads = 2  # fresh: key/value heads
  c.student.head_dim = 16  # fresh: width of one head
  c.student.d_ff = 128  # fresh: MLP hidden width
  c.student.tie_embeddings = True  # fresh: output head shares the embedding matrix
  c.student.freeze_embeddings = False  # keep the token (and position) embeddings fixed
  c.student.freeze_head = False  # keep the output head fixed (a tied head is the embedding)
  c.student.freeze_layers = ()  # indices of draft blocks kept fixed, e.g. (0, 1)
  c.student.feature_layers = "eagle3"  # eagle_head, dflash_head: target features read: "eagle3" (low, middle, high
  #                                      blocks), "last" (EAGLE-1: the final-norm hidden state) or "1,5,9"
  c.student.ttt_steps = 7  # eagle_head: drafting steps unrolled by the training-time test (loss 0.8^j)
  c.student.draft_vocab = 0  # eagle_head: train (and export) the head over the Vd tokens most frequent in the
  #                            training rows (stop tokens included), EAGLE-3's draft vocabulary: a Vd-column
  #                            output projection, V / Vd times cheaper (0 = the full vocabulary)
  c.student.parallel_k = 4  # parallel: K, the draft tokens one pass proposes (masks per block: K - 1)
  c.student.cod_keep = 0.7  # parallel: conditional drop, masks of depth j below this ^ j of the anchors (1 = all)
  c.student.dflash_block = 4  # dflash_head: K, the block one pass fills ([anchor token, MASK x (K - 1)])
  c.student.dflash_anchors = 8  # dflash_head: random anchors (blocks) trained per row and step
  c.student.dflash_gamma = 4.0  # dflash_head: block slot j's loss weighted exp(-j / gamma) (DFlash's decay)
  c.student.feature_loss_weight = 0.0  # eagle_head, feature_layers "last": weight of EAGLE-1's smooth-L1
  #                                      regression of the head's output on the target's next hidden state

  c.data = ml_collections.ConfigDict()
  c.data.source = "stdlib"  # "stdlib", a directory, a glob, a .jsonl file or a text file
  c.data.pattern = "**/*.py"  # files matched below a directory source
  c.data.jsonl_field = "text"  # the string field of each JSONL record
  c.data.heldout_fraction = 0.05  # documents held out for evaluation (split by document)
  c.data.max_train_tokens = 0  # cap on the tokenized training stream (0 = all of it)
  c.data.max_heldout_tokens = 0  # cap on the tokenized held-out stream (0 = all of it)
  c.data.seq_len = 128  # tokens per training row (packed across documents)
  c.data.batch_size = 8  # rows per step
  c.data.modes = ml_collections.ConfigDict({"fixed": 1.0, "target": 0.0, "student": 0.0})  # mixing weights
  c.data.prompt_len = 32  # generated modes: tokens of each row kept as the prompt, the rest is generated
  c.data.temperature = 1.0  # generated modes: sampling temperature of the continuations (0 = greedy)

  c.loss = ml_collections.ConfigDict()
  c.loss.divergence = "forward_kl"  # "forward_kl" KL(q||p), "reverse_kl" KL(p||q), "jsd", "tvd"
  c.loss.temperature = 1.0  # both models' logits are divided by it before the divergence
  c.loss.beta = 0.5  # jsd: the teacher's weight in the mixture m = beta q + (1 - beta) p

  c.optim = ml_collections.ConfigDict()
  c.optim.learning_rate = 3e-4  # peak learning rate of AdamW
  c.optim.warmup_steps = 100  # linear warmup from 0 to the peak
  c.optim.final_lr_fraction = 0.1  # cosine decay ends at this fraction of the peak
  c.optim.weight_decay = 0.01  # decoupled weight decay (matrices only)
  c.optim.b1 = 0.9  # Adam first-moment decay
  c.optim.b2 = 0.95  # Adam second-moment decay
  c.optim.grad_clip = 1.0  # clip the global gradient norm to this (0 = no clipping)

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
