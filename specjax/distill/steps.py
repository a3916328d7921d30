"""The compiled pieces of distillation: optimizer, train state, one train step and one eval step.

The train step is one `jax.jit` program: the teacher's logits (under `stop_gradient`, never
differentiated), the student's logits, the masked divergence, its gradient, and the optax update, with
the previous state's buffers donated. Frozen parameters get `optax.set_to_zero()` through
`optax.multi_transform`, so their gradients are never needed and XLA drops their computation.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax

from specjax.distill import losses
from specjax.distill.student import FROZEN, TRAIN
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import Params, forward


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # [] int32: optimizer steps taken (= batches consumed)
  params: Params  # the student's parameters
  opt_state: optax.OptState  # the multi_transform(AdamW, set_to_zero) state
  key: jax.Array  # [2] uint32 raw PRNG key of the run; batch i samples with fold_in(key, i)


def make_optimizer(optim: ml_collections.ConfigDict, num_steps: int,
                   labels: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Clipping + AdamW on a warmup-cosine schedule for TRAIN leaves, zero updates for FROZEN ones.
  Weight decay skips vectors (norm scales, biases)."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=optim.learning_rate, warmup_steps=optim.warmup_steps,
      decay_steps=max(num_steps, optim.warmup_steps + 1), end_value=optim.learning_rate * optim.final_lr_fraction)
  adamw = optax.adamw(schedule, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay,
                      mask=lambda params: jax.tree.map(lambda p: p.ndim > 1, params))
  train = optax.chain(optax.clip_by_global_norm(optim.grad_clip), adamw) if optim.grad_clip else adamw
  return optax.multi_transform({TRAIN: train, FROZEN: optax.set_to_zero()}, labels), schedule


def init_state(params: Params, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
  return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params),
                    key=jax.random.key_data(jax.random.key(seed)))


def logits(config: ModelConfig, params: Params, tokens_BxT: jax.Array) -> jax.Array:
  """Float32 logits [B, T, V] of a full sequence (a fresh cache of exactly T positions), with dense
  attention: every key is live, and the blockwise loop's data-dependent trip count cannot be
  reverse-differentiated."""
  B, T = tokens_BxT.shape
  config = config.replace(attention_block=0)
  logits_BxTxV, _ = forward(config, params, tokens_BxT, init_cache(config, B, T))
  return logits_BxTxV


def make_train_step(teacher_config: ModelConfig, student_config: ModelConfig,
                    optimizer: optax.GradientTransformation, schedule: optax.Schedule, labels: Any,
                    loss: ml_collections.ConfigDict) -> Callable:
  """`train_step(state, teacher_params, tokens_BxT, mask_BxT) -> (state, metrics)`, jitted, `state`
  donated. Metrics (float32 scalars): the masked loss, the trainable gradients' global norm (before
  clipping) and the learning rate of this step."""

  @functools.partial(jax.jit, donate_argnames=("state",))
  def train_step(state: TrainState, teacher_params: Params, tokens_BxT: jax.Array, mask_BxT: jax.Array):
    teacher_BxTxV = jax.lax.stop_gradient(logits(teacher_config, teacher_params, tokens_BxT))

    def loss_fn(params):
      student_BxTxV = logits(student_config, params, tokens_BxT)
      per_token_BxT = losses.token_divergence(loss.divergence, teacher_BxTxV, student_BxTxV,
                                              loss.temperature, loss.beta)
      return losses.masked_mean(per_token_BxT, mask_BxT)

    value, grads = jax.value_and_grad(loss_fn)(state.params)
    trainable = jax.tree.map(lambda g, label: g if label == TRAIN else None, grads, labels)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state)
    metrics = {"loss": value, "grad_norm": optax.tree.norm(trainable),
               "learning_rate": jnp.asarray(schedule(state.step), jnp.float32)}
    return new_state, metrics

  return train_step


def make_eval_step(teacher_config: ModelConfig, student_config: ModelConfig, loss: ml_collections.ConfigDict,
                   acceptance_temperature: float) -> Callable:
  """`eval_step(student_params, teacher_params, tokens_BxT, mask_BxT) -> sums`, jitted: masked sums of
  the training loss, the expected acceptance sum_x min(p, q) at `acceptance_temperature`, and the
  greedy (argmax) agreement, plus the number of valid tokens, to be summed over batches."""

  @jax.jit
  def eval_step(student_params: Params, teacher_params: Params, tokens_BxT: jax.Array, mask_BxT: jax.Array):
    teacher_BxTxV = logits(teacher_config, teacher_params, tokens_BxT)
    student_BxTxV = logits(student_config, student_params, tokens_BxT)
    weight_BxT = mask_BxT.astype(jnp.float32)
    per_token = {
        "loss": losses.token_divergence(loss.divergence, teacher_BxTxV, student_BxTxV, loss.temperature,
                                        loss.beta),
        "acceptance": losses.expected_acceptance(teacher_BxTxV, student_BxTxV, acceptance_temperature),
        "greedy_agreement": losses.greedy_agreement(teacher_BxTxV, student_BxTxV),
    }
    sums = {name: jnp.sum(value_BxT * weight_BxT) for name, value_BxT in per_token.items()}
    return {**sums, "tokens": jnp.sum(weight_BxT)}

  return eval_step
