"""The compiled pieces of distillation: optimizer, train state, one train step and one eval step.

The train step is one `jax.jit` program: the teacher's logits (under `stop_gradient`, never
differentiated), the student's logits, the masked divergence, its gradient, and the optax update, with
the previous state's buffers donated. Frozen parameters get `optax.set_to_zero()` through
`optax.multi_transform`, so their gradients are never needed and XLA drops their computation.

The state keeps float32 master parameters and float32 Adam moments whatever the model's dtype: an Adam
step of ~lr = 5e-5 is below half the spacing of bfloat16 numbers of magnitude >= 2^-6, so bfloat16
weights updated in place would not move there (~44% of std-0.02 weights). The step casts the master to
the model dtype inside the differentiated function (`model_params`): the forward and backward compute in
that dtype and the cast's transpose hands float32 gradients to the optimizer. The teacher runs in its
own dtype. (float16 gets no loss scaling: its small gradients may underflow in the backward.)

On a device mesh (`Placement`): batch rows on `data`; the state's master parameters and Adam moments
FSDP-style (`partitioning.FSDP_RULES`: split over `model` by the tensor-parallel rules and over `data`
on their residual width); the teacher as a decode target (`DECODE_RULES`). The jitted steps declare
these as `in_shardings` / `out_shardings` and run under `jax.set_mesh`; inside, the student's model
params are pinned to the tensor-parallel layout (each weight gathered over `data` where it is used,
its gradient reduce-scattered back: the transpose of that constraint), and GSPMD partitions the rest.
Results equal one device's up to float rounding: sums split across devices add in another order.

Gradient accumulation (`accum_steps` = A): the batch's B rows are split into A micro-batches of B/A
rows (micro-batch a holds rows a, a + A, a + 2A, ...: each stays split over `data`), run one after
the other in a `lax.scan`; each contributes its masked divergence sum divided by the *whole batch's*
token count, so the summed gradient is the gradient of the full batch's masked mean (the same step as
A = 1 up to float rounding, for any masks), with one optimizer update per step. Peak activation memory
is that of B/A rows. The student config's `remat` wraps each of its blocks in `jax.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jax.sharding import Mesh, NamedSharding

from specjax import partitioning
from specjax.distill import losses
from specjax.distill.pard import PlainLayout
from specjax.distill.student import FROZEN, TRAIN
from specjax.models.config import ModelConfig
from specjax.models.layout import to_layout
from specjax.models.transformer import Params


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # [] int32: optimizer steps taken (= batches consumed)
  params: Params  # the student's float32 master parameters, per-layer layout (`layers_{i}`)
  opt_state: optax.OptState  # the multi_transform(AdamW, set_to_zero) state, float32 moments
  key: jax.Array  # [2] uint32 raw PRNG key of the run; batch i samples with fold_in(key, i)


class Optimizer(NamedTuple):
  """The update rule and its learning-rate schedule (`make_optimizer`)."""

  transform: optax.GradientTransformation
  schedule: optax.Schedule


def make_optimizer(optim: ml_collections.ConfigDict, num_steps: int, labels: Any) -> Optimizer:
  """Clipping + AdamW on a warmup-cosine schedule for TRAIN leaves, zero updates for FROZEN ones.
  Weight decay skips vectors (norm scales, biases)."""
  schedule = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=optim.learning_rate,
                                                warmup_steps=optim.warmup_steps,
                                                decay_steps=max(num_steps, optim.warmup_steps + 1),
                                                end_value=optim.learning_rate * optim.final_lr_fraction)
  adamw = optax.adamw(schedule, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay,
                      mask=lambda params: jax.tree.map(lambda p: p.ndim > 1, params))
  train = optax.chain(optax.clip_by_global_norm(optim.grad_clip), adamw) if optim.grad_clip else adamw
  return Optimizer(optax.multi_transform({TRAIN: train, FROZEN: optax.set_to_zero()}, labels), schedule)


def init_state(params: Params, optimizer: optax.GradientTransformation, seed: int, shardings: Any = None) -> TrainState:
  """Step 0 of a run from the student's initial per-layer `params` (any float dtype): a float32 master
  copy and float32 optimizer moments; laid out by `shardings` (a TrainState of `NamedSharding`s,
  `Placement.state`) when given, each device building only its shards."""
  def make(params):
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return TrainState(step=jnp.int32(0), params=master, opt_state=optimizer.init(master),
                      key=jax.random.key_data(jax.random.key(seed)))

  return make(params) if shardings is None else jax.jit(make, out_shardings=shardings)(params)


def _param_name(path) -> str:
  """"layers_0/attn/q_proj/weight" from a state leaf's key path: its trailing dictionary keys (a
  master parameter's, or an optimizer moment's, which optax keeps in trees shaped like the params)."""
  keys = []
  for key in reversed(path):
    if not isinstance(key, jax.tree_util.DictKey):
      break
    keys.append(str(key.key))
  return "/".join(reversed(keys))


def state_shardings(config: ModelConfig, state: TrainState, part: partitioning.Partitioning) -> TrainState:
  """A TrainState of `NamedSharding`s for `state` (arrays or shape structs): master params and every
  optimizer leaf shaped like a parameter (Adam's moments) by `part`'s rules; scalars (step, Adam's
  count) and the RNG key replicated."""
  params = partitioning.param_shardings(config, state.params, part)
  by_name = {
      _param_name(path): (sharding, leaf.shape)
      for (path, sharding), leaf in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(state.params))
  }

  def sharding(path, leaf):
    found = by_name.get(_param_name(path))
    return found[0] if found and found[1] == leaf.shape else part.sharding()

  return jax.tree_util.tree_map_with_path(sharding, state)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where the train and eval steps' arrays live on a mesh (see the module docstring)."""

  mesh: Mesh
  state: Any  # TrainState of NamedShardings (FSDP rules; scalars and key replicated)
  teacher: Any  # the teacher's params' shardings (decode rules), a tree like its params
  compute: Any  # the student's model params as its forward uses them (decode rules, model layout)
  rows: NamedSharding  # batches [B, T]: rows on `data`

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, jax.sharding.PartitionSpec())


def placement(student_config: ModelConfig, state: TrainState, teacher_params: Params,
              student_part: partitioning.Partitioning, compute_part: partitioning.Partitioning) -> Placement:
  """The `Placement` of a run: `state` (arrays or shape structs) laid out by `student_part` (FSDP
  rules), the student's forward by `compute_part` (decode rules), the teacher where its params are."""
  compute_shapes = jax.eval_shape(lambda p: model_params(student_config, p), state.params)
  return Placement(mesh=student_part.mesh, state=state_shardings(student_config, state, student_part),
                   teacher=jax.tree.map(lambda p: p.sharding, teacher_params),
                   compute=partitioning.param_shardings(student_config, compute_shapes,
                                                        compute_part), rows=partitioning.rows_sharding(student_part))


def put_rows(array: Any, placement: Placement | None) -> jax.Array:
  """A host batch [B, ...] as a global array with rows on `data` (each process places only the rows of
  its own devices, cut from its identical host copy); unchanged without a placement."""
  if placement is None:
    return array
  array = np.asarray(array)
  return jax.make_array_from_callback(array.shape, placement.rows, lambda index: array[index])


def _on_mesh(jitted: Callable, mesh: Mesh | None) -> Callable:
  """`jitted`, called (and traced) under `jax.set_mesh(mesh)` when there is a mesh."""
  if mesh is None:
    return jitted

  @functools.wraps(jitted)
  def call(*args, **kwargs):
    with jax.set_mesh(mesh):
      return jitted(*args, **kwargs)

  return call


def model_params(config: ModelConfig, master: Params) -> Params:
  """The master parameters as the model runs them: in `config.dtype`, in the layout `config.scan_layers`
  asks for. What the train and eval steps compute with, and what decoding and export receive."""
  return to_layout(config, jax.tree.map(lambda p: p.astype(config.jnp_dtype), master))


def logits(config: ModelConfig, params: Params, tokens_BxT: jax.Array) -> jax.Array:
  """Float32 logits [B, T, V] of a full sequence (a fresh cache of exactly T positions), with dense
  attention (`pard.dense`)."""
  return PlainLayout().student_logits(config, params, tokens_BxT)


def paired_logits(teacher_config: ModelConfig, teacher_params: Params, student_config: ModelConfig, student: Params,
                  tokens_BxT: jax.Array, layout: PlainLayout) -> tuple[jax.Array, jax.Array]:
  """(the target's logits each student node learns, under `stop_gradient`; the student's) [B, N, W]
  for the rows `tokens_BxT`, node by node as `layout` lays them out (the plain one: N = T)."""
  teacher_BxTxV = jax.lax.stop_gradient(logits(teacher_config, teacher_params, tokens_BxT))
  student_BxNxW = layout.student_logits(student_config, student, tokens_BxT)
  return layout.teacher_logits(teacher_BxTxV, student_BxNxW.shape[-1]), student_BxNxW


def make_train_step(teacher_config: ModelConfig, student_config: ModelConfig, optimizer: Optimizer, labels: Any,
                    loss: ml_collections.ConfigDict, accum_steps: int = 1, placement: Placement | None = None,
                    layout: PlainLayout = PlainLayout()) -> Callable:
  """`train_step(state, teacher_params, tokens_BxT, mask_BxT) -> (state, metrics)`, jitted, `state`
  donated. Metrics (float32 scalars): the masked loss, the trainable gradients' global norm (before
  clipping) and the learning rate of this step. `accum_steps` micro-batches per step (B must be a
  multiple of it), `placement` on a mesh: see the module docstring; `student_config.remat` checkpoints
  each student block; `layout` (static) the nodes the student is trained at (`pard`: PARD's mask blocks)."""
  constrain = ((lambda tree, shardings: jax.lax.with_sharding_constraint(tree, shardings)) if placement is not None else
               (lambda tree, shardings: tree))

  def divergence_sum(master, teacher_params, tokens_BxT, mask_BxT):
    """The masked sum of the per-token divergence over these rows (float32)."""
    student = constrain(model_params(student_config, master), placement and placement.compute)
    teacher_BxNxW, student_BxNxW = paired_logits(teacher_config, teacher_params, student_config, student, tokens_BxT,
                                                 layout)
    per_node_BxN = losses.token_divergence(loss.divergence, teacher_BxNxW, student_BxNxW, loss.temperature, loss.beta)
    return jnp.sum(per_node_BxN * layout.weights(mask_BxT))

  def loss_and_grads(master, teacher_params, tokens_BxT, mask_BxT):
    """The full batch's masked mean divergence and its gradient, over `accum_steps` micro-batches."""
    count = jnp.maximum(jnp.sum(layout.weights(mask_BxT)), 1.0)  # of the whole batch: each micro-batch divides by it
    mean = lambda master, tokens, mask: divergence_sum(master, teacher_params, tokens, mask) / count
    if accum_steps == 1:
      return jax.value_and_grad(mean)(master, tokens_BxT, mask_BxT)
    B, T = tokens_BxT.shape
    micro = lambda x_BxT: partitioning.constrain(  # [A, B/A, T]: micro-batch a = rows a, a + A, ...
        x_BxT.reshape(B // accum_steps, accum_steps, T).transpose(1, 0, 2), None, "data", None)

    def add(carry, batch):
      value, grads = jax.value_and_grad(mean)(master, *batch)
      total, summed = carry
      return (total + value, constrain(jax.tree.map(jnp.add, summed, grads), placement and
                                       placement.state.params)), None

    zeros = constrain(jax.tree.map(jnp.zeros_like, master), placement and placement.state.params)
    (value, grads), _ = jax.lax.scan(add, (jnp.float32(0.0), zeros), (micro(tokens_BxT), micro(mask_BxT)))
    return value, grads

  def train_step(state: TrainState, teacher_params: Params, tokens_BxT: jax.Array, mask_BxT: jax.Array):
    value, grads = loss_and_grads(state.params, teacher_params, tokens_BxT, mask_BxT)
    trainable = jax.tree.map(lambda g, label: g if label == TRAIN else None, grads, labels)
    updates, opt_state = optimizer.transform.update(grads, state.opt_state, state.params)
    new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state)
    metrics = {
        "loss": value, "grad_norm": optax.tree.norm(trainable),
        "learning_rate": jnp.asarray(optimizer.schedule(state.step), jnp.float32)
    }
    return new_state, metrics

  if placement is None:
    return jax.jit(train_step, donate_argnames=("state",))
  return _on_mesh(
      jax.jit(train_step, donate_argnames=("state",),
              in_shardings=(placement.state, placement.teacher, placement.rows, placement.rows),
              out_shardings=(placement.state, placement.replicated)), placement.mesh)


def make_eval_step(teacher_config: ModelConfig, student_config: ModelConfig, loss: ml_collections.ConfigDict,
                   acceptance_temperature: float, placement: Placement | None = None,
                   layout: PlainLayout = PlainLayout()) -> Callable:
  """`eval_step(student_master, teacher_params, tokens_BxT, mask_BxT) -> sums`, jitted: masked sums of
  the training loss, the expected acceptance sum_x min(p, q) at `acceptance_temperature`, and the
  greedy (argmax) agreement, plus the number of valid tokens, to be summed over batches; a layout with
  several draft positions (`pard`) adds the acceptance, the greedy agreement and the valid nodes per
  position [K] ("acceptance_at", "greedy_agreement_at", "tokens_at"). The student's float32 master runs
  in its dtype, as in training."""
  def eval_step(student_master: Params, teacher_params: Params, tokens_BxT: jax.Array, mask_BxT: jax.Array):
    student = model_params(student_config, student_master)
    if placement is not None:
      student = jax.lax.with_sharding_constraint(student, placement.compute)
    teacher_BxNxW, student_BxNxW = paired_logits(teacher_config, teacher_params, student_config, student, tokens_BxT,
                                                 layout)
    weight_BxN = layout.weights(mask_BxT)
    acceptance_BxN = losses.expected_acceptance(teacher_BxNxW, student_BxNxW, acceptance_temperature)
    per_node = {
        "loss": losses.token_divergence(loss.divergence, teacher_BxNxW, student_BxNxW, loss.temperature, loss.beta),
        "acceptance": acceptance_BxN,
        "greedy_agreement": losses.greedy_agreement(teacher_BxNxW, student_BxNxW),
    }
    sums = {name: jnp.sum(value_BxN * weight_BxN) for name, value_BxN in per_node.items()}
    if layout.positions > 1:  # the acceptance metrics per draft position, and the valid nodes at each
      at_NxK = jax.nn.one_hot(layout.position_of(tokens_BxT.shape[1]), layout.positions, dtype=jnp.float32)
      sums.update(
          {
              f"{name}_at": jnp.sum(per_node[name] * weight_BxN, axis=0) @ at_NxK
              for name in ("acceptance", "greedy_agreement")
          }, tokens_at=jnp.sum(weight_BxN, axis=0) @ at_NxK)
    return {**sums, "tokens": jnp.sum(weight_BxN)}

  if placement is None:
    return jax.jit(eval_step)
  return _on_mesh(
      jax.jit(eval_step, in_shardings=(placement.state.params, placement.teacher, placement.rows, placement.rows),
              out_shardings=placement.replicated), placement.mesh)
