"""Training an EAGLE head (`specjax.speculative.drafters.eagle`) on the target's own features: EAGLE-3's
training-time test, its train step and its held-out evaluation.

Training-time test (TTT). On a sequence x_0 .. x_{T-1} the target gives features f_t and logits. A draft
chain starting at position t (what `EagleDrafter.propose` does after history x_0 .. x_t, pending x_{t+1})
runs n steps: step 0 reads (f_t, x_{t+1}), step j >= 1 reads (the head's own output of step j - 1,
x_{t+1+j}) at position t + j, and step j predicts x_{t+2+j}. Its attention sees the step-0 pairs of
positions <= t (the target's features: the head's cache when drafting) and its own chain's steps 1 .. j.
All T chains run at once, step by step: step j's keys are kept per chain (the "diagonal" of each step),
so the unroll costs n passes of T tokens instead of T chains. Each pass runs the head's one block
(`eagle.head_forward`, drafting's own) with this attention pattern as its core (`_ttt_attention`, which
keeps the block's sliding window and score soft-cap). The tokens fed are the data's (teacher forcing of
tokens; the features are the head's own, as when drafting). The loss of step j is KL(target || head) at
every position, weighted 0.8^j (EAGLE-3's weights), averaged over valid positions; for a head reading
the final hidden state, EAGLE-1's regression of the head's output on the target's next hidden state can
be added (`feature_regression`).

A head that drafts through a restricted vocabulary (`DraftHead`: Vd of the V tokens, EAGLE-3's draft
vocabulary) trains over those Vd tokens only: its logits are [.., Vd] and the target's distribution is
renormalised over the same Vd (the best a head scoring only them can do), which makes the output
projection and its gradient V / Vd times cheaper. The expected acceptance stays the true one,
sum over the Vd tokens of min(p, q) with q the target's full distribution (mass outside them is never
accepted).

The held-out metric `acceptance_length` simulates drafting: with a_j the expected acceptance
sum_x min(p, q) of step j at a chain's start, a chain accepts sum_j prod_{i <= j} a_i draft tokens on
average (tokens after a rejection are not drafted from the data in reality: an estimate).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from specjax.distill import losses
from specjax.distill.steps import TrainState
from specjax.models import attention_mask
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import Params, forward_features, hidden_to_logits
from specjax.speculative.drafters.draft_head import DraftHead
from specjax.speculative.drafters.eagle_head import Core, EagleConfig, fuse, head_forward, head_scores

STEP_WEIGHT = 0.8  # EAGLE-3's weight of TTT step j: STEP_WEIGHT ** j


def _ttt_attention(block: ModelConfig, q_BxTxHxDh: jax.Array, k_BxTxGxDh: jax.Array, v_BxTxGxDh: jax.Array,
                   steps: tuple, layer: int, tree=None) -> tuple[jax.Array, tuple]:
  """The training-time test's attention core (`transformer.Attention`, in the head's one block): `steps`
  holds the keys and values [B, T, G, Dh] of the steps before this one, j. The query of the chain
  at t (position t + j) sees the step-0 keys of positions <= t and its own chain's keys of steps 1 .. j
  (the "diagonal" of each step), those in the layer's window, as the head drafting from its cache does.
  Scores scaled and soft-capped as in `attention`, softmax in float32. Returns [B, T, H, Dh] and the
  steps with this one's keys and values appended."""
  steps = steps + ((k_BxTxGxDh, v_BxTxGxDh),)
  j, (keys0_BxTxGxDh, values0_BxTxGxDh), diagonal = len(steps) - 1, steps[0], steps[1:]
  B, T, H, _ = q_BxTxHxDh.shape
  window = block.layer_windows()[layer]
  group = H // block.n_kv_heads
  expand = lambda x_BxTxGxDh: jnp.repeat(x_BxTxGxDh, group, axis=2)
  score = lambda s: attention_mask.soft_cap(s * block.attention_scale(), block.attn_softcap)
  causal_BxHxTxS = score(
      jnp.einsum("bthd,bshd->bhts", q_BxTxHxDh, expand(keys0_BxTxGxDh), preferred_element_type=jnp.float32))
  chain_T = jnp.arange(T)
  visible_TxS = chain_T[None, :] <= chain_T[:, None]
  if window:  # the query at t + j, the step-0 key at its own position s
    visible_TxS = visible_TxS & (chain_T[None, :] > chain_T[:, None] + j - window)
  causal_BxHxTxS = jnp.where(visible_TxS[None, None], causal_BxHxTxS, -jnp.inf)
  # Step i's key of the same chain sits at t + i: in the window iff j - i < window.
  diagonal = [pair for i, pair in enumerate(diagonal, 1) if not window or j - i < window]
  diag_BxHxTxJ = jnp.stack([
      score(jnp.einsum("bthd,bthd->bht", q_BxTxHxDh, expand(keys_BxTxGxDh), preferred_element_type=jnp.float32))
      for keys_BxTxGxDh, _ in diagonal
  ], axis=-1) if diagonal else jnp.zeros((B, H, T, 0))
  weights_BxHxTxSJ = jax.nn.softmax(jnp.concatenate([causal_BxHxTxS, diag_BxHxTxJ], axis=-1), axis=-1)
  out_BxTxHxDh = jnp.einsum("bhts,bshd->bthd", weights_BxHxTxSJ[..., :T].astype(values0_BxTxGxDh.dtype),
                            expand(values0_BxTxGxDh))
  for i, (_, values_BxTxGxDh) in enumerate(diagonal):
    weights_BxTxHx1 = weights_BxHxTxSJ[..., T + i].transpose(0, 2, 1)[..., None].astype(values_BxTxGxDh.dtype)
    out_BxTxHxDh = out_BxTxHxDh + weights_BxTxHx1 * expand(values_BxTxGxDh)
  return out_BxTxHxDh, steps


def ttt_unroll(config: EagleConfig, params: Params, target_config: ModelConfig, target_params: Params,
               tokens_BxT: jax.Array, features_BxTxF: jax.Array, num_steps: int,
               vocab: DraftHead | None = None) -> list[tuple[jax.Array, jax.Array]]:
  """The head's outputs [B, T, D] and float32 logits [B, T, V] (a restricted `vocab`: [B, T, Vd], its
  tokens' `head_scores`) of each TTT step j < `num_steps` for the chains starting at every position t
  (step j at t predicts x_{t+2+j}; fed tokens past the sequence are id 0, their outputs are masked by
  the caller)."""
  B, T = tokens_BxT.shape
  embedding_VxD = target_params["embed"]["embedding"]
  hidden_BxTxD = fuse(config, params, features_BxTxF)
  steps, unrolled = (), []
  for j in range(num_steps):
    fed_BxT = jnp.pad(tokens_BxT[:, 1 + j:], ((0, 0), (0, min(1 + j, T))))[:, :T]
    positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + j, (B, T))
    hidden_BxTxD, steps = head_forward(config, params, embedding_VxD, fed_BxT, hidden_BxTxD, steps,
                                       core=Core(_ttt_attention, positions_BxT))
    unrolled.append((hidden_BxTxD, head_scores(config, params, target_config, target_params, vocab, hidden_BxTxD)))
  return unrolled


def target_features(target_config: ModelConfig, target_params: Params, feature_layers: tuple[int, ...],
                    tokens_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The target's features [B, T, F] and float32 logits [B, T, V] of full sequences (never
  differentiated: the target is fixed)."""
  B, T = tokens_BxT.shape
  config = target_config.replace(attention="dense")
  hidden_BxTxD, features_BxTxF, _ = forward_features(config, target_params, tokens_BxT, init_cache(config, B, T),
                                                     feature_layers)
  return jax.lax.stop_gradient((features_BxTxF, hidden_to_logits(config, target_params, hidden_BxTxD)))


def _step_targets(target_logits_BxTxV: jax.Array, mask_BxT: jax.Array, j: int):
  """For TTT step j: the target's logits at t + 1 + j (its distribution of x_{t+2+j}) and where that is
  a valid, masked-in position of the sequence."""
  T = mask_BxT.shape[1]
  shift = lambda x: jnp.pad(x[:, 1 + j:], ((0, 0), (0, min(1 + j, T))) + ((0, 0),) * (x.ndim - 2))[:, :T]
  return shift(target_logits_BxTxV), shift(mask_BxT.astype(jnp.float32))


def feature_regression(out_BxTxD: jax.Array, features_BxTxD: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """EAGLE-1's feature loss: the masked mean over positions t of smooth-L1(out_t - f_{t+1}) (Huber,
  delta 1, averaged over D): the head's step-0 output regressed on the target's next hidden state."""
  T = mask_BxT.shape[1]
  next_BxTxD = jnp.pad(features_BxTxD[:, 1:], ((0, 0), (0, min(1, T)), (0, 0))).astype(jnp.float32)
  valid_BxT = jnp.pad(mask_BxT[:, 1:], ((0, 0), (0, min(1, T)))).astype(jnp.float32)
  per_token_BxT = jnp.mean(optax.huber_loss(out_BxTxD.astype(jnp.float32), next_BxTxD), axis=-1)
  return losses.masked_mean(per_token_BxT, valid_BxT)


def expected_acceptance(target_logits_xV: jax.Array, head_logits_xVd: jax.Array, vocab: DraftHead | None) -> jax.Array:
  """sum_x min(p(x), q(x)) [...] at temperature 1 for a head's logits over its own vocabulary (all V
  tokens, or the Vd of `vocab`) against the target's over all V."""
  q_xV = jax.nn.softmax(target_logits_xV.astype(jnp.float32), axis=-1)
  q_xVd = q_xV if vocab is None else jnp.take(q_xV, vocab.tokens_Vd, axis=-1)
  return jnp.sum(jnp.minimum(jax.nn.softmax(head_logits_xVd, axis=-1), q_xVd), axis=-1)


class Objective(NamedTuple):
  """What the head is trained on (static): `num_steps` TTT steps unrolled, and `feature_weight` times
  EAGLE-1's `feature_regression` (heads reading the final hidden state only; 0 = off)."""

  num_steps: int
  feature_weight: float = 0.0


def ttt_loss(config: EagleConfig, params: Params, target_config: ModelConfig, target_params: Params,
             tokens_BxT: jax.Array, mask_BxT: jax.Array, objective: Objective,
             vocab: DraftHead | None = None) -> tuple[jax.Array, dict]:
  """sum_j 0.8^j masked-mean KL(target || head) of TTT step j (plus the objective's feature regression),
  and per-step expected acceptances [B, T] with their masks (for `acceptance_length`). A restricted
  `vocab`: the KL of the target renormalised over its Vd tokens; the acceptances against the target's
  full distribution."""
  num_steps, feature_weight = objective
  if feature_weight and config.feature_layers:
    raise ValueError("the feature regression needs a head reading the target's final hidden state "
                     "(feature_layers 'last'): a fused EAGLE-3 feature is the head's own projection")
  features_BxTxF, target_BxTxV = target_features(target_config, target_params, config.feature_layers, tokens_BxT)
  unrolled = ttt_unroll(config, params, target_config, target_params, tokens_BxT, features_BxTxF, num_steps, vocab)
  total, accepts = jnp.float32(0.0), []
  if feature_weight:
    total = feature_weight * feature_regression(unrolled[0][0], features_BxTxF, mask_BxT)
  for j, (_, logits_BxTxV) in enumerate(unrolled):
    teacher_BxTxV, valid_BxT = _step_targets(target_BxTxV, mask_BxT, j)
    teacher_own = teacher_BxTxV if vocab is None else jnp.take(teacher_BxTxV, vocab.tokens_Vd, axis=-1)
    kl_BxT = losses.token_divergence("forward_kl", teacher_own, logits_BxTxV)
    total = total + STEP_WEIGHT**j * losses.masked_mean(jnp.where(valid_BxT > 0, kl_BxT, 0.0), valid_BxT)
    accepts.append((expected_acceptance(teacher_BxTxV, logits_BxTxV, vocab), valid_BxT))
  return total, {"accepts": accepts}


def acceptance_length(accepts: list[tuple[jax.Array, jax.Array]]) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(sum over chains of the expected accepted draft tokens, sum of step 0's expected acceptance, chains):
  chains are the positions where every step is valid; chain t accepts sum_j prod_{i <= j} a_i."""
  valid_BxT = jnp.prod(jnp.stack([valid for _, valid in accepts]), axis=0)
  prefix_JxBxT = jnp.cumprod(jnp.stack([a for a, _ in accepts]), axis=0)
  return (jnp.sum(jnp.sum(prefix_JxBxT, axis=0) * valid_BxT), jnp.sum(accepts[0][0] * valid_BxT), jnp.sum(valid_BxT))


def run_params(config: EagleConfig, master: Params) -> Params:
  """The head's float32 master weights in the dtype it runs (and is exported) in."""
  return jax.tree.map(lambda p: p.astype(config.block.jnp_dtype), master)


def make_head_train_step(config: EagleConfig, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                         loss: Callable) -> Callable:
  """`train_step(state, target_params, tokens_BxT, mask_BxT, vocab=None) -> (state, metrics)`, jitted,
  `state` donated, for any head objective `loss(params, target_params, tokens, mask, vocab, key) -> scalar`
  (`params` the master weights in the block's dtype, `key` = fold_in(the run's key, the step): a resumed
  run draws the same); `state.params` are the head's float32 master weights."""
  def train_step(state: TrainState, target_params: Params, tokens_BxT: jax.Array, mask_BxT: jax.Array,
                 vocab: DraftHead | None = None):
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)
    value, grads = jax.value_and_grad(
        lambda master: loss(run_params(config, master), target_params, tokens_BxT, mask_BxT, vocab, key))(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    metrics = {
        "loss": value, "grad_norm": optax.tree.norm(grads),
        "learning_rate": jnp.asarray(schedule(state.step), jnp.float32)
    }
    return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state), metrics

  return jax.jit(train_step, donate_argnames=("state",))


def make_head_eval_step(config: EagleConfig, sums: Callable) -> Callable:
  """`eval_step(master, target_params, tokens_BxT, mask_BxT, vocab=None) -> sums`, jitted, for any head
  objective's `sums(params, target_params, tokens, mask, vocab)` (to be summed over batches)."""
  return jax.jit(lambda master, target_params, tokens_BxT, mask_BxT, vocab=None: sums(
      run_params(config, master), target_params, tokens_BxT, mask_BxT, vocab))


def make_train_step(config: EagleConfig, target_config: ModelConfig, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, num_steps: int, feature_weight: float = 0.0) -> Callable:
  """The EAGLE head's `make_head_train_step`: `ttt_loss` (over the restricted `vocab`'s tokens when given)."""
  objective = Objective(num_steps, feature_weight)
  return make_head_train_step(
      config, optimizer, schedule, lambda params, target_params, tokens_BxT, mask_BxT, vocab, key: ttt_loss(
          config, params, target_config, target_params, tokens_BxT, mask_BxT, objective, vocab)[0])


def make_eval_step(config: EagleConfig, target_config: ModelConfig, num_steps: int,
                   feature_weight: float = 0.0) -> Callable:
  """The EAGLE head's `make_head_eval_step`: the TTT loss times the valid chains, expected accepted length
  and first-step acceptance summed over chains, and the chains (`tokens`)."""
  def sums(params, target_params, tokens_BxT, mask_BxT, vocab):
    loss, extra = ttt_loss(config, params, target_config, target_params, tokens_BxT, mask_BxT,
                           Objective(num_steps, feature_weight), vocab)
    length, first, chains = acceptance_length(extra["accepts"])
    return {"loss": loss * chains, "acceptance_length": length, "acceptance": first, "tokens": chains}

  return make_head_eval_step(config, sums)
