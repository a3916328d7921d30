"""Training EAGLE heads: the training-time-test unroll equals running the head step by step as the drafter
does (its cache filled with the target's features, its own outputs fed back); a few optimizer steps on a
tiny target lower the loss and raise the simulated acceptance length."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from specjax.distill import eagle_steps, steps
from specjax.distill.student import TRAIN
from specjax.speculative.eagle import EagleDrafter, head_forward, head_logits
from tests.test_eagle import _head
from tests.test_layer_skip import TARGET

TOKENS_2x10 = jnp.asarray([[5, 17, 3, 44, 9, 1, 2, 60, 7, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
NUM_STEPS = 3


@pytest.mark.parametrize("feature_layers", [(0, 1, 2), ()])
def test_training_time_test_equals_the_head_run_step_by_step(feature_layers):
  config, params = _head(TARGET[0], feature_layers)
  target_config, target_params = TARGET
  features_BxTxF, _ = eagle_steps.target_features(target_config, target_params, feature_layers, TOKENS_2x10)
  ttt = eagle_steps.ttt_logits(config, params, target_config, target_params, TOKENS_2x10, features_BxTxF, NUM_STEPS)
  drafter = EagleDrafter(config, params, target_config, target_params)
  embedding_VxD = target_params["embed"]["embedding"]
  for n in (1, 2, 4, 6):  # history x_0 .. x_{n-1}, pending x_n: the chain starting at position n - 1
    state = drafter.init(drafter.storage(2, 16), TOKENS_2x10[:, :n], jnp.full((2,), n), None)
    cache, feature_BxD, token_B = state.cache, state.feature, TOKENS_2x10[:, n]
    for j in range(NUM_STEPS):
      out_Bx1xD, written = head_forward(config, params, embedding_VxD, token_B[:, None], feature_BxD[:, None], cache)
      logits_BxV = head_logits(config, params, target_config, target_params, None, out_Bx1xD[:, 0])
      np.testing.assert_allclose(ttt[j][:, n - 1], logits_BxV, rtol=2e-4, atol=2e-4, err_msg=f"n={n} j={j}")
      cache, feature_BxD, token_B = written.advance(jnp.ones(2, jnp.int32)), out_Bx1xD[:, 0], TOKENS_2x10[:, n + 1 + j]
  assert not np.allclose(ttt[0], ttt[1])


def test_training_lowers_the_loss_and_raises_the_acceptance_length():
  config, params = _head(TARGET[0], (0, 1, 2), final_scale=1.0)
  target_config, target_params = TARGET
  optim = ml_collections.ConfigDict(dict(learning_rate=3e-3, warmup_steps=0, final_lr_fraction=1.0,
                                         weight_decay=0.0, b1=0.9, b2=0.95, grad_clip=1.0))
  labels = jax.tree.map(lambda _: TRAIN, params)
  optimizer, schedule = steps.make_optimizer(optim, 30, labels)
  train_step = eagle_steps.make_train_step(config, target_config, optimizer, schedule, NUM_STEPS)
  eval_step = eagle_steps.make_eval_step(config, target_config, NUM_STEPS)
  mask_BxT = jnp.ones(TOKENS_2x10.shape, bool)
  state = steps.init_state(params, optimizer, seed=0)
  before = eval_step(state.params, target_params, TOKENS_2x10, mask_BxT)
  losses = []
  for _ in range(30):
    state, metrics = train_step(state, target_params, TOKENS_2x10, mask_BxT)
    losses.append(float(metrics["loss"]))
  after = eval_step(state.params, target_params, TOKENS_2x10, mask_BxT)
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]
  assert float(after["acceptance_length"]) > float(before["acceptance_length"]) + 0.1 * float(after["tokens"])
  assert int(after["tokens"]) == 2 * (10 - NUM_STEPS)  # chains t whose last step has a target: t + NUM_STEPS <= 9
