"""The train step of a bfloat16 student keeps float32 master weights: one small step moves every trainable
weight, where the same step applied to bfloat16 weights leaves many of them where they were. The model
receives the master in its dtype and layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.distill import steps, student
from specjax.distill.config import default_config
from specjax.models.config import ModelConfig
from specjax.models.layout import stack_layers
from specjax.models.transformer import init_params

TEACHER = ModelConfig(arch="llama", vocab_size=61, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24,
                      dtype="bfloat16")  # untied: embedding rows of absent tokens move by decay only
TOKENS_BxT = np.asarray(jax.random.randint(jax.random.key(2), (4, 16), 0, TEACHER.vocab_size), np.int32)
MASK_BxT = np.ones(TOKENS_BxT.shape, bool)


@pytest.fixture(scope="module")
def setup():
  """(teacher params, student config, student params (bfloat16), labels with layer 1 frozen, train step
  at learning rate 5e-5 without warmup, with the default weight decay and clipping)."""
  teacher_params = init_params(TEACHER, jax.random.key(0))
  config, params = student.truncate(TEACHER, teacher_params, 2)
  labels = student.frozen_labels(config, params, False, False, (1,))
  optim = default_config().optim
  optim.learning_rate, optim.warmup_steps = 5e-5, 0
  optimizer, schedule = steps.make_optimizer(optim, 10, labels)
  train_step = steps.make_train_step(TEACHER, config, steps.Optimizer(optimizer, schedule), labels,
                                     default_config().loss)
  return teacher_params, params, labels, optimizer, train_step


def _changed(before, after, labels, label):
  """Elements of the `label` leaves that differ between the two trees: (changed, total)."""
  pairs = [(np.asarray(b), np.asarray(a))
           for b, a, l in zip(jax.tree.leaves(before), jax.tree.leaves(after), jax.tree.leaves(labels))
           if l == label]
  return sum(int(np.sum(b != a)) for b, a in pairs), sum(b.size for b, _ in pairs)


def test_one_small_step_moves_every_trainable_float32_master_weight(setup):
  teacher_params, params, labels, optimizer, train_step = setup
  state = steps.init_state(params, optimizer, seed=0)
  assert {p.dtype for p in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  assert {p.dtype for p in jax.tree.leaves(state.opt_state) if p.ndim} == {jnp.dtype(jnp.float32)}
  before = jax.device_get(state.params)
  state, metrics = train_step(state, teacher_params, TOKENS_BxT, MASK_BxT)
  assert metrics["loss"].dtype == jnp.float32 and float(metrics["learning_rate"]) == pytest.approx(5e-5)
  changed, total = _changed(before, state.params, labels, student.TRAIN)
  assert changed == total > 0
  assert _changed(before, state.params, labels,
                  student.FROZEN) == (0, sum(p.size for p in jax.tree.leaves(params["layers_1"])))
  assert {p.dtype for p in jax.tree.leaves(steps.model_params(TEACHER, state.params))} == {TEACHER.jnp_dtype}


def test_the_same_step_on_bfloat16_weights_leaves_many_unchanged(setup):
  """The measurement detects the bug it guards against: Adam's first step is ~lr = 5e-5 per element,
  below half the bfloat16 spacing (2^-15) of every weight of magnitude >= 2^-6."""
  teacher_params, params, labels, optimizer, train_step = setup
  bf16_params = jax.tree.map(jnp.copy, params)  # the step donates them
  state = steps.TrainState(step=jnp.int32(0), params=bf16_params, opt_state=optimizer.init(bf16_params),
                           key=jax.random.key_data(jax.random.key(0)))
  state, _ = train_step(state, teacher_params, TOKENS_BxT, MASK_BxT)
  assert {p.dtype for p in jax.tree.leaves(state.params)} == {TEACHER.jnp_dtype}
  changed, total = _changed(params, state.params, labels, student.TRAIN)
  assert (total - changed) / total > 0.1


def test_the_model_gets_the_master_in_its_dtype_and_layout(setup):
  """A scanning student config gets the per-layer master stacked (bfloat16 -> float32 -> bfloat16 is exact)."""
  _, params, *_ = setup
  master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  got = steps.model_params(TEACHER.replace(n_layers=2, scan_layers=True), master)
  want = stack_layers(params, 2)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert {p.dtype for p in jax.tree.leaves(got)} == {TEACHER.jnp_dtype}


def test_a_stacked_train_step_equals_the_per_layer_one():
  """float32 teacher and student, one step: the scanning layout trains the same weights."""
  teacher = TEACHER.replace(dtype="float32")
  teacher_params = init_params(teacher, jax.random.key(0))
  results = []
  for scan in (False, True):
    teacher_config = teacher.replace(scan_layers=scan)
    config, params = student.truncate(teacher_config, stack_layers(teacher_params, 3) if scan else teacher_params, 2)
    labels = student.frozen_labels(config, params, False, False, ())
    optimizer, schedule = steps.make_optimizer(default_config().optim, 10, labels)
    train_step = steps.make_train_step(teacher_config, config, steps.Optimizer(optimizer, schedule), labels,
                                       default_config().loss)
    state, metrics = train_step(steps.init_state(params, optimizer, seed=0),
                                steps.model_params(teacher_config, teacher_params), TOKENS_BxT, MASK_BxT)
    results.append((jax.device_get(state.params), float(metrics["loss"])))
  assert results[1][1] == pytest.approx(results[0][1], rel=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), results[1][0], results[0][0])
