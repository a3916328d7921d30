"""Student initialisation (layer-truncated, fresh) from either parameter layout, and freezing through the
optimizer."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from specjax.distill import steps, student
from specjax.distill.config import default_config
from specjax.models.config import ModelConfig
from specjax.models.layout import stack_layers
from specjax.models.transformer import init_params

TARGET = ModelConfig(arch="llama", vocab_size=61, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24,
                     tie_embeddings=True)


@pytest.fixture(scope="module")
def target_params():
  return init_params(TARGET, jax.random.key(0))


def test_truncate_keeps_first_layers_embeddings_norm_and_head_as_copies(target_params):
  config, params = student.truncate(TARGET, target_params, 2)
  assert config == TARGET.replace(n_layers=2)
  assert sorted(params) == ["embed", "final_norm", "layers_0", "layers_1"]
  jax.tree.map(np.testing.assert_array_equal, params["layers_1"], target_params["layers_1"])
  assert params["embed"]["embedding"] is not target_params["embed"]["embedding"]  # donation-safe
  with pytest.raises(ValueError, match=r"num_layers must be in \[1, 3\]"):
    student.truncate(TARGET, target_params, 4)


def test_a_stacked_target_truncates_to_the_same_per_layer_student(target_params):
  """A target loaded for scanned layers (one `layers` subtree with a leading [L] axis) gives the same
  student, per layer, which `frozen_labels` accepts and the stacked layout it refuses."""
  stacked = stack_layers(target_params, TARGET.n_layers)
  config, params = student.truncate(TARGET.replace(scan_layers=True), stacked, 2)
  assert config == TARGET.replace(n_layers=2, scan_layers=True)
  _, want = student.truncate(TARGET, target_params, 2)
  assert jax.tree.structure(params) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, params, want)
  labels = student.frozen_labels(config, params, False, False, (1,))
  assert set(jax.tree.leaves(labels["layers_1"])) == {student.FROZEN}
  with pytest.raises(ValueError, match="needs the per-layer layout"):
    student.frozen_labels(config, stack_layers(params, 2), False, False, ())


def test_fresh_student_has_the_targets_vocabulary_and_architecture():
  spec = ml_collections.ConfigDict(
      dict(d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=4, d_ff=8, tie_embeddings=False))
  config, params = student.fresh(TARGET, spec, jax.random.key(1))
  assert (config.vocab_size, config.arch, config.n_layers, config.tie_embeddings) == (61, "llama", 1, False)
  assert params["lm_head"]["weight"].shape == (61, 8)
  with pytest.raises(ValueError, match=r"student vocabulary \(61 ids\) != teacher vocabulary \(62 ids\)"):
    student.check_vocab(config, TARGET.replace(vocab_size=62))


def test_frozen_parameters_get_zero_updates(target_params):
  labels = student.frozen_labels(TARGET, target_params, freeze_embeddings=True, freeze_head=False, freeze_layers=(1,))
  optimizer, _ = steps.make_optimizer(default_config().optim, 10, labels)
  grads = jax.tree.map(jnp.ones_like, target_params)
  state = optimizer.init(target_params)
  for _ in range(3):  # past step 0, where warmup makes every update zero
    updates, state = optimizer.update(grads, state, target_params)
  moved = {name: any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(tree)) for name, tree in updates.items()}
  assert moved == {"embed": False, "layers_0": True, "layers_1": False, "layers_2": True, "final_norm": True}


def test_freezing_a_tied_head_freezes_the_embedding_and_bad_layers_are_an_error(target_params):
  labels = student.frozen_labels(TARGET, target_params, False, True, ())
  assert set(jax.tree.leaves(labels["embed"])) == {student.FROZEN}
  with pytest.raises(ValueError, match="out of range"):
    student.frozen_labels(TARGET, target_params, False, False, (3,))
