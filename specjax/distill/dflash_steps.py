"""Training a DFlash block head (`specjax.speculative.drafters.dflash`) on the target's own features: random
anchors, the block loss and its held-out sums (its steps: `objectives.dflash`).

A row x_0 .. x_{T-1} gives the target's features f_t and logits. Drafting after history x_0 .. x_{a-1}
with pending x_a (an *anchor* a >= 1) feeds the block [(f_{a-1}, x_a), (f_{a-1}, MASK) x (K - 1)] at
positions a - 1 .. a + K - 2, seeing the head's cache of pairs (f_t, x_{t+1}), t <= a - 2, and the whole
block; slot j predicts x_{a+1+j}. One pass over a row trains M random anchors at once, as a tree for the
model's attention (`AnchorLayout`, one per row): the T - 1 context pairs form a causal chain (what `commit`
writes, from the target's features), and each anchor's K slots see the context below it and each other.
Slot j is trained toward the target's distribution at a + j (its next-token distribution there) by
KL(target || head), weighted exp(-j / gamma) (DFlash's decay over the block: early slots decide whether
later ones count), each slot's KL averaged over its valid anchors (a + j < T, inside the row's loss mask).

The anchors of training step i are drawn from fold_in(the run's key, i) inside the step
(`eagle_steps.make_head_train_step`): a resumed run draws the same ones. The evaluation uses fixed
anchors (one seeded draw per batch shape) and reports the expected acceptance sum_x min(p, q) per block
slot (`acceptance_at`) and the expected accepted length (`eagle_steps.acceptance_length`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from specjax.distill import losses
from specjax.distill.eagle_steps import acceptance_length, expected_acceptance, target_features
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import Params
from specjax.speculative.drafters.eagle_head import MASK_ID, EagleConfig, fuse, head_forward, head_scores

EVAL_KEY = 0  # the seed of the evaluation's fixed anchors


class BlockObjective(NamedTuple):
  """What the head is trained on (static): blocks of `block` slots, `anchors` per row, slot j's KL
  weighted exp(-j / `gamma`)."""

  block: int
  anchors: int
  gamma: float

  def weights(self) -> jax.Array:
    return jnp.exp(-jnp.arange(self.block, dtype=jnp.float32) / self.gamma)


@flax.struct.dataclass
class AnchorLayout:
  """One row's context chain and anchor blocks as a per-row tree chunk (`attention_mask`): N = T - 1 + M K
  nodes, context pair c (f_c, x_{c+1}) at position c, then block m's slot j at position a_m - 1 + j."""

  depth: jax.Array  # [B, N] int32 node positions
  ancestors_BxNxN: jax.Array  # [B, N, N] bool: which nodes each node sees
  first: int = flax.struct.field(pytree_node=False, default=0)  # the whole layout is one chunk

  @property
  def key_depth(self) -> jax.Array:
    return self.depth

  def ancestor_mask(self) -> jax.Array:
    return self.ancestors_BxNxN


def anchor_layout(anchors_BxM: jax.Array, seq_len: int, block: int) -> AnchorLayout:
  """The layout of rows of `seq_len` tokens with K = `block` slots below each anchor a in [1, T - 1]."""
  batch, m = anchors_BxM.shape
  context = seq_len - 1
  slot_J = jnp.arange(block)
  block_pos_BxMK = (anchors_BxM[:, :, None] - 1 + slot_J[None, None, :]).reshape(batch, m * block)
  depth_BxN = jnp.concatenate([jnp.broadcast_to(jnp.arange(context), (batch, context)), block_pos_BxMK], axis=1)
  c_C = jnp.arange(context)
  causal_CxC = c_C[None, :] <= c_C[:, None]
  below_BxMKxC = (c_C[None, None, :] <= jnp.repeat(anchors_BxM, block, axis=1)[:, :, None] - 2)
  owner_MK = jnp.repeat(jnp.arange(m), block)
  same_MKxMK = owner_MK[:, None] == owner_MK[None, :]
  top_BxCxN = jnp.broadcast_to(jnp.concatenate([causal_CxC, jnp.zeros((context, m * block), bool)], axis=1),
                               (batch, context, context + m * block))
  bottom_BxMKxN = jnp.concatenate([below_BxMKxC, jnp.broadcast_to(same_MKxMK, (batch, m * block, m * block))], axis=2)
  return AnchorLayout(depth=depth_BxN, ancestors_BxNxN=jnp.concatenate([top_BxCxN, bottom_BxMKxN], axis=1))


def draw_anchors(key: jax.Array, batch: int, seq_len: int, anchors: int) -> jax.Array:
  """[B, M] int32 anchors, uniform in [1, T - 1] (independent; a repeat trains that anchor twice)."""
  return jax.random.randint(key, (batch, anchors), 1, seq_len, jnp.int32)


def block_logits(config: EagleConfig, params: Params, target_config: ModelConfig, target_params: Params,
                 tokens_BxT: jax.Array, features_BxTxF: jax.Array, anchors_BxM: jax.Array, block: int) -> jax.Array:
  """Float32 logits [B, M, K, V] of each anchor's block, from one head pass over the row's layout."""
  B, T = tokens_BxT.shape
  m = anchors_BxM.shape[1]
  fused_BxTxD = fuse(config, params, features_BxTxF)
  anchor_fused_BxMxD = jnp.take_along_axis(fused_BxTxD, (anchors_BxM - 1)[:, :, None], axis=1)
  anchor_tokens_BxM = jnp.take_along_axis(tokens_BxT, anchors_BxM, axis=1)
  block_tokens_BxMK = jnp.pad(anchor_tokens_BxM[:, :, None], ((0, 0), (0, 0), (0, block - 1)),
                              constant_values=MASK_ID).reshape(B, m * block)
  tokens_BxN = jnp.concatenate([tokens_BxT[:, 1:], block_tokens_BxMK], axis=1)
  fused_BxNxD = jnp.concatenate([fused_BxTxD[:, :-1], jnp.repeat(anchor_fused_BxMxD, block, axis=1)], axis=1)
  dense = dataclasses.replace(config, block=config.block.replace(attention="dense"))
  cache = init_cache(dense.block, B, tokens_BxN.shape[1])
  out_BxNxD, _ = head_forward(dense, params, target_params["embed"]["embedding"], tokens_BxN, fused_BxNxD, cache,
                              tree=anchor_layout(anchors_BxM, T, block))
  logits_BxMKxV = head_scores(config, params, target_config, target_params, None, out_BxNxD[:, T - 1:])
  return logits_BxMKxV.reshape(B, m, block, -1)


def block_loss(config: EagleConfig, params: Params, target_config: ModelConfig, target_params: Params,
               tokens_BxT: jax.Array, mask_BxT: jax.Array, objective: BlockObjective,
               key: jax.Array) -> tuple[jax.Array, dict]:
  """sum_j exp(-j / gamma) masked-mean KL(target || head) of block slot j over the anchors drawn from
  `key`, and per slot the expected acceptances [B, M] with their masks (`accepts`) and the greedy
  agreements [B, M] (`agrees`)."""
  B, T = tokens_BxT.shape
  features_BxTxF, target_BxTxV = target_features(target_config, target_params, config.feature_layers, tokens_BxT)
  anchors_BxM = draw_anchors(key, B, T, objective.anchors)
  logits_BxMxKxV = block_logits(config, params, target_config, target_params, tokens_BxT, features_BxTxF, anchors_BxM,
                                objective.block)
  total, accepts, agrees = jnp.float32(0.0), [], []
  for j, weight in enumerate(objective.weights()):
    source_BxM = anchors_BxM + j  # the target's distribution of x_{a+1+j} sits at a + j
    inside_BxM = source_BxM < T
    source_BxM = jnp.minimum(source_BxM, T - 1)
    teacher_BxMxV = jnp.take_along_axis(target_BxTxV, source_BxM[:, :, None], axis=1)
    valid_BxM = (inside_BxM & jnp.take_along_axis(mask_BxT, source_BxM, axis=1)).astype(jnp.float32)
    kl_BxM = losses.token_divergence("forward_kl", teacher_BxMxV, logits_BxMxKxV[:, :, j])
    total = total + weight * losses.masked_mean(jnp.where(valid_BxM > 0, kl_BxM, 0.0), valid_BxM)
    accepts.append((expected_acceptance(teacher_BxMxV, logits_BxMxKxV[:, :, j], None), valid_BxM))
    agrees.append(losses.greedy_agreement(teacher_BxMxV, logits_BxMxKxV[:, :, j]))
  return total, {"accepts": accepts, "agrees": agrees}


def eval_sums(config: EagleConfig, params: Params, target_config: ModelConfig, target_params: Params,
              tokens_BxT: jax.Array, mask_BxT: jax.Array, objective: BlockObjective) -> dict:
  """The held-out sums of one batch at its fixed anchors: the loss times the valid blocks, expected
  accepted length and first-slot acceptance summed over blocks, and per slot the acceptance and the
  greedy agreement and the valid anchors (`acceptance_at`, `greedy_agreement_at`, `tokens_at`)."""
  loss, extra = block_loss(config, params, target_config, target_params, tokens_BxT, mask_BxT, objective,
                           jax.random.key(EVAL_KEY))
  length, first, chains = acceptance_length(extra["accepts"])
  return {
      "loss": loss * chains, "acceptance_length": length, "acceptance": first, "tokens": chains,
      "acceptance_at": jnp.stack([jnp.sum(a * v) for a, v in extra["accepts"]]),
      "greedy_agreement_at": jnp.stack([jnp.sum(g * v) for g, (_, v) in zip(extra["agrees"], extra["accepts"])]),
      "tokens_at": jnp.stack([jnp.sum(v) for _, v in extra["accepts"]])
  }
