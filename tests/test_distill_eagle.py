"""Training EAGLE heads: the training-time-test unroll equals running the head step by step as the drafter
does (its cache filled with the target's features, its own outputs fed back); a few optimizer steps on a
tiny target lower the loss and raise the simulated acceptance length; a head trained on the target's
greedy output drafts most of it, and greedy decoding with it still equals the target's (long accepted
blocks, an EOS inside one)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from specjax import metrics
from specjax.distill import eagle_steps, steps
from specjax.distill.student import TRAIN
from specjax.generation import as_token_lists
from specjax.speculative.drafters.draft_head import restrict_head
from specjax.speculative.drafters.eagle import EagleDrafter
from specjax.speculative.drafters.eagle_head import head_forward, head_logits
from tests.helpers.eagle import eagle_head, run_eagle
from tests.helpers.engine import PROMPTS
from tests.helpers.layer_skip import TARGET, target_greedy_3

TOKENS_2x10 = jnp.asarray([[5, 17, 3, 44, 9, 1, 2, 60, 7, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
NUM_STEPS = 3

SLIDING_3 = ("sliding_attention",) * 3


@pytest.mark.slow
@pytest.mark.parametrize(
    "feature_layers, block",
    [
        ((0, 1, 2), {}),
        ((), {}),
        ((0, 1, 2), {"qkv_bias": True}),  # Qwen2: biases of 1 on q, k and v
        ((0, 1, 2), {"sliding_window": 2}),  # Mistral: a window shorter than the chains' reach
        ((), {
            "arch": "gemma", "attn_softcap": 2.0, "query_pre_attn_scalar": 16, "sliding_window": 3,
            "layer_types": SLIDING_3
        }),  # Gemma 2
        ((0, 1, 2), {
            "arch": "gemma", "qk_norm": True, "rope_local_theta": 100.0, "sliding_window": 2, "layer_types": SLIDING_3
        }),  # Gemma 3
    ])
def test_training_time_test_equals_the_head_run_step_by_step(feature_layers, block):
  """`block`: the head block's family options (the target stays the plain llama one)."""
  target_config, target_params = TARGET
  config, params = eagle_head(target_config.replace(**block), feature_layers)
  assert ("bias" in params["layer"]["attn"]["q_proj"]) == block.get("qkv_bias", False)
  features_BxTxF, _ = jax.jit(eagle_steps.target_features, static_argnums=(0, 2))(target_config, target_params,
                                                                                  feature_layers, TOKENS_2x10)
  ttt = [
      logits for _, logits in jax.jit(eagle_steps.ttt_unroll, static_argnums=(
          0, 2, 6))(config, params, target_config, target_params, TOKENS_2x10, features_BxTxF, NUM_STEPS)
  ]
  drafter = EagleDrafter(config, params, target_config, target_params)
  embedding_VxD = target_params["embed"]["embedding"]
  # Compiled once each (op by op, the six cases took ~3 minutes on 2 cores).
  init = jax.jit(
      lambda prompts_BxP: drafter.init(drafter.storage(2, 16), prompts_BxP, jnp.full((2,), prompts_BxP.shape[1]), None))
  forward = jax.jit(head_forward, static_argnums=0)
  to_logits = jax.jit(lambda out_BxD: head_logits(config, params, target_config, target_params, None, out_BxD))
  for n in (1, 2, 4, 6):  # history x_0 .. x_{n-1}, pending x_n: the chain starting at position n - 1
    state = init(TOKENS_2x10[:, :n])
    cache, feature_BxD, token_B = state.cache, state.feature, TOKENS_2x10[:, n]
    for j in range(NUM_STEPS):
      out_Bx1xD, written = forward(config, params, embedding_VxD, token_B[:, None], feature_BxD[:, None], cache)
      logits_BxV = to_logits(out_Bx1xD[:, 0])
      np.testing.assert_allclose(ttt[j][:, n - 1], logits_BxV, rtol=2e-4, atol=2e-4, err_msg=f"n={n} j={j}")
      cache, feature_BxD, token_B = written.advance(jnp.ones(2, jnp.int32)), out_Bx1xD[:, 0], TOKENS_2x10[:, n + 1 + j]
  assert not np.allclose(ttt[0], ttt[1])


def test_eagle1_feature_regression_adds_to_the_loss():
  config, params = eagle_head(TARGET[0], ())
  target_config, target_params = TARGET
  mask_BxT = jnp.ones(TOKENS_2x10.shape, bool)
  loss = lambda weight: eagle_steps.ttt_loss(config, params, target_config, target_params, TOKENS_2x10, mask_BxT,
                                             eagle_steps.Objective(NUM_STEPS, weight))[0]
  features_BxTxD, _ = eagle_steps.target_features(target_config, target_params, (), TOKENS_2x10)
  out_BxTxD = np.asarray(
      eagle_steps.ttt_unroll(config, params, target_config, target_params, TOKENS_2x10, features_BxTxD, 1)[0][0])
  error = out_BxTxD[:, :-1] - np.asarray(features_BxTxD)[:, 1:]  # the output at t against the target's f_{t+1}
  huber = np.where(np.abs(error) < 1, 0.5 * error**2, np.abs(error) - 0.5).mean()
  np.testing.assert_allclose(loss(0.5), loss(0.0) + 0.5 * huber, rtol=1e-5)
  with pytest.raises(ValueError, match="final hidden state"):
    eagle_steps.ttt_loss(*eagle_head(TARGET[0], (0, 1, 2)), target_config, target_params, TOKENS_2x10, mask_BxT,
                         eagle_steps.Objective(NUM_STEPS, 0.5))


def test_a_restricted_vocabulary_trains_over_its_tokens_against_the_full_target():
  """The unroll's Vd-column logits are the full head's at those tokens; the loss is KL against the target
  renormalised over the Vd tokens, the acceptance sum_Vd min(p, q) against the target's full q (float64
  reference: a loss over the unrenormalised target, or an acceptance against the renormalised one, fails)."""
  target_config, target_params = TARGET
  config, params = eagle_head(target_config, (0, 1, 2))
  vocab = restrict_head(target_config, target_params, np.arange(1, target_config.vocab_size, 3))
  tokens_Vd = np.asarray(vocab.tokens_Vd)
  features_BxTxF, target_BxTxV = eagle_steps.target_features(target_config, target_params, (0, 1, 2), TOKENS_2x10)
  full = eagle_steps.ttt_unroll(config, params, target_config, target_params, TOKENS_2x10, features_BxTxF, NUM_STEPS)
  restricted = eagle_steps.ttt_unroll(config, params, target_config, target_params, TOKENS_2x10, features_BxTxF,
                                      NUM_STEPS, vocab)
  mask_BxT = jnp.asarray(np.arange(10)[None, :] < np.asarray([[10], [7]]))
  loss, extra = eagle_steps.ttt_loss(config, params, target_config, target_params, TOKENS_2x10, mask_BxT,
                                     eagle_steps.Objective(NUM_STEPS), vocab=vocab)
  softmax = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
  want_loss = 0.0
  for j in range(NUM_STEPS):
    np.testing.assert_allclose(restricted[j][1], np.asarray(full[j][1])[..., tokens_Vd], rtol=1e-5, atol=1e-5)
    p_BxTxVd = softmax(np.asarray(restricted[j][1], np.float64))
    q_BxTxV = softmax(np.asarray(target_BxTxV, np.float64)[:, 1 + j:])  # the target at t + 1 + j
    q_restricted = q_BxTxV[..., tokens_Vd] / q_BxTxV[..., tokens_Vd].sum(-1, keepdims=True)
    kl_BxT = np.sum(q_restricted * (np.log(q_restricted) - np.log(p_BxTxVd[:, :10 - 1 - j])), axis=-1)
    valid_BxT = np.asarray(mask_BxT)[:, 1 + j:]
    want_loss += 0.8**j * np.sum(kl_BxT * valid_BxT) / valid_BxT.sum()
    accept_BxT, accept_valid_BxT = (np.asarray(x) for x in extra["accepts"][j])
    want_accept_BxT = np.minimum(p_BxTxVd[:, :10 - 1 - j], q_BxTxV[..., tokens_Vd]).sum(-1)
    np.testing.assert_allclose(accept_BxT[:, :10 - 1 - j], want_accept_BxT, rtol=1e-5, atol=1e-6, err_msg=f"j={j}")
    np.testing.assert_array_equal(accept_valid_BxT[:, :10 - 1 - j], valid_BxT)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)


def _train_step(config, params, learning_rate, num_steps):
  optim = ml_collections.ConfigDict(
      dict(learning_rate=learning_rate, warmup_steps=0, final_lr_fraction=1.0, weight_decay=0.0, b1=0.9, b2=0.95,
           grad_clip=1.0))
  optimizer, schedule = steps.make_optimizer(optim, num_steps, jax.tree.map(lambda _: TRAIN, params))
  return (eagle_steps.make_train_step(config, TARGET[0], optimizer, schedule,
                                      NUM_STEPS), steps.init_state(params, optimizer, seed=0))


def test_training_lowers_the_loss_and_raises_the_acceptance_length():
  config, params = eagle_head(TARGET[0], (0, 1, 2))
  target_config, target_params = TARGET
  train_step, state = _train_step(config, params, 3e-3, 30)
  eval_step = eagle_steps.make_eval_step(config, target_config, NUM_STEPS)
  mask_BxT = jnp.ones(TOKENS_2x10.shape, bool)
  before = eval_step(state.params, target_params, TOKENS_2x10, mask_BxT)
  losses = []
  for _ in range(30):
    state, metrics = train_step(state, target_params, TOKENS_2x10, mask_BxT)
    losses.append(float(metrics["loss"]))
  after = eval_step(state.params, target_params, TOKENS_2x10, mask_BxT)
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]
  assert float(after["acceptance_length"]) > float(before["acceptance_length"]) + 0.1 * float(after["tokens"])
  assert int(after["tokens"]) == 2 * (10 - NUM_STEPS)  # chains t whose last step has a target: t + NUM_STEPS <= 9


def test_a_head_trained_on_the_targets_output_drafts_it_and_greedy_stays_exact():
  """150 steps on the target's greedy continuations of the test prompts (over-fitting on purpose: long
  accepted blocks exercise `commit` with many tokens, and an EOS inside an accepted block)."""
  greedy = target_greedy_3()
  width = max(len(p) + len(g) for p, g in zip(PROMPTS, greedy))
  tokens_BxT = jnp.asarray([(p + g + [0] * width)[:width] for p, g in zip(PROMPTS, greedy)])
  mask_BxT = jnp.arange(width)[None, :] < jnp.asarray([len(p) + len(g) for p, g in zip(PROMPTS, greedy)])[:, None]
  config, params = eagle_head(TARGET[0], (0, 1, 2))
  train_step, state = _train_step(config, params, 1e-2, 150)
  for _ in range(150):
    state, _ = train_step(state, TARGET[1], tokens_BxT, mask_BxT)
  drafter = EagleDrafter(config, state.params, *TARGET)
  one = run_eagle(TARGET, drafter, 1)
  assert as_token_lists(one.tokens, one.counts) == greedy
  assert metrics.summarize(one.acceptance)["total"]["acceptance_rate"] > 0.6
  eight = run_eagle(TARGET, drafter, 8)
  assert as_token_lists(eight.tokens, eight.counts) == greedy
  assert metrics.summarize(eight.acceptance)["total"]["mean_accepted_length"] > 2.0
  eos = [greedy[2][6]]
  stopped = run_eagle(TARGET, drafter, 8, eos_ids=eos)
  assert as_token_lists(stopped.tokens, stopped.counts) == target_greedy_3(eos_ids=eos)
  assert as_token_lists(stopped.tokens, stopped.counts)[2] == greedy[2][:greedy[2].index(eos[0]) + 1]
