"""Distillation on a device mesh (8 simulated CPU devices, in a subprocess:
`tests/helpers/distill_mesh_worker.py`).

Three sharded steps (data=2,model=4; model=8; data=8) equal three one-device steps; gradient accumulation
(2 and 4 micro-batches, uneven masks) equals one step over the whole batch; rematerialisation changes no
bit; every student weight and Adam moment is split as the FSDP rules say; a run killed on a mesh resumes
bit for bit, and its checkpoint restores onto another mesh shape (and one device) with the same bits and
trains on; bad settings fail with one clear line before anything loads or compiles.

Tolerances. The step comparisons train with plain SGD (lr 0.5), whose update is the gradient: parameters
then differ only by the rounding of the gradients' sums, which a mesh splits across devices and adds in
another order (float32: observed max |diff| <= 1.2e-7 after 3 steps that moved weights by ~2e-2; the test
allows 1e-6, 1/20000 of the movement). With AdamW (the runs' optimizer) the same steps differ by up to
~1.5e-3 in a minority of elements: Adam divides each gradient element by its own magnitude, so an element
whose gradient is near zero (below the rounding of the sums that make it) moves by an amount that
rounding decides; losses and gradient norms still agree to 1e-4 (1e-6 at the first step, before the
parameters differ).
"""

from __future__ import annotations

import functools

import pytest

from tests.helpers.multidevice import run_worker

PARAM_TOLERANCE = 1e-6  # SGD parameters after 3 steps (float32 sums reordered across devices)
METRIC_RTOL = 1e-5  # losses and gradient norms of the SGD steps


@functools.lru_cache(maxsize=None)
def _worker(*args: str) -> dict:
  # XLA's default emitters: the bit-equality of rematerialisation (`steps`) is a property of the code
  # they emit. A resumed run's bits are a property of determinism, which the tests' faster emitters keep
  # (`resume` took 24 s with them against 41 s).
  return run_worker("distill_mesh_worker.py", *args, fusion_emitters=args[0] == "steps")


@pytest.fixture(scope="module")
def resume(tmp_path_factory):
  return _worker("resume", str(tmp_path_factory.mktemp("distill_mesh")))


def _assert_same_step(results, name):
  got, base = results[name], results["base"]
  assert got["param_diff"] <= PARAM_TOLERANCE, (name, got["param_diff"])
  assert got["losses"] == pytest.approx(base["losses"], rel=METRIC_RTOL)
  assert got["grad_norms"] == pytest.approx(base["grad_norms"], rel=METRIC_RTOL)
  assert got["moved"] > 1000 * PARAM_TOLERANCE  # the steps did train: the comparison is not of idle weights


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data=2,model=4", "model=8", "data=8"])
def test_three_sharded_steps_equal_three_one_device_steps(mesh):
  _assert_same_step(_worker("steps"), mesh)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["accum2", "accum4", "data=2,model=4|accum2"])
def test_accumulated_micro_batches_equal_one_step_of_the_whole_batch(variant):
  """Micro-batches of 4 and 2 rows (uneven token counts) against the 8-row batch: one optimizer update
  per step either way, the same loss, gradient norm and parameters."""
  _assert_same_step(_worker("steps"), variant)


@pytest.mark.slow
def test_accumulation_runs_micro_batches_in_a_scan():
  results = _worker("steps")
  assert results["jaxpr_accum2"]["scans"] == 1 and results["jaxpr_accum2"]["length=2"] >= 1
  assert results["jaxpr_plain"]["scans"] == 0


@pytest.mark.slow
def test_rematerialisation_changes_no_bit():
  results = _worker("steps")
  assert results["remat_bit_equal"] and results["mesh_remat_bit_equal"]
  _assert_same_step(results, "remat")
  # It is really there: jax.checkpoint (`remat2` in the jaxpr) in the step's program, and none without.
  assert results["jaxpr_remat"]["checkpoints"] >= 1 and results["jaxpr_plain"]["checkpoints"] == 0


@pytest.mark.slow
def test_adamw_steps_on_a_mesh_agree_up_to_adams_amplified_rounding():
  adam = _worker("steps")["adamw"]
  assert adam["losses"][0] == pytest.approx(adam["base_losses"][0], rel=1e-6)
  assert adam["grad_norms"][0] == pytest.approx(adam["base_grad_norms"][0], rel=1e-6)
  assert adam["losses"] == pytest.approx(adam["base_losses"], rel=1e-4)
  assert adam["grad_norms"] == pytest.approx(adam["base_grad_norms"], rel=1e-4)
  assert adam["param_diff"] < 0.2 * adam["moved"]


@pytest.mark.slow
def test_every_student_weight_and_adam_moment_is_split_as_the_fsdp_rules_say():
  """data=2,model=4, d_model 64 on data, heads / MLP / vocabulary on model; 4 key/value heads of 8 dims
  split over model=4. Norm scales are whole. Adam's mu and nu are laid out like their parameters."""
  shards = _worker("steps")["shards"]
  assert shards["devices"] == list(range(8))
  want = {
      "['embed']['embedding']": [128 // 4, 64 // 2], "['lm_head']['weight']": [128 // 4, 64 // 2],
      "['layers_0']['attn']['q_proj']['weight']": [64 // 4, 64 // 2
                                                  ], "['layers_0']['attn']['k_proj']['weight']": [32 // 4, 64 // 2],
      "['layers_0']['attn']['v_proj']['weight']": [32 // 4, 64 // 2
                                                  ], "['layers_0']['attn']['o_proj']['weight']": [64 // 2, 64 // 4],
      "['layers_0']['mlp']['gate_proj']['weight']": [128 // 4, 64 // 2
                                                    ], "['layers_0']['mlp']['up_proj']['weight']": [128 // 4, 64 // 2],
      "['layers_0']['mlp']['down_proj']['weight']": [64 // 2, 128 // 4], "['layers_0']['attn_norm']['scale']": [64],
      "['layers_0']['mlp_norm']['scale']": [64], "['final_norm']['scale']": [64]
  }
  params = {name.removeprefix(".params"): shape for name, shape in shards["params"].items()}
  assert params == want
  for moment in ("mu", "nu"):
    got = {
        name.split(f".{moment}", 1)[1]: shape for name, shape in shards["opt_state"].items() if f".{moment}[" in name
    }
    assert got == want, moment


@pytest.mark.slow
def test_killed_run_on_a_mesh_resumes_bit_for_bit(resume):
  """data=2,model=4 with on-policy batches (generated on the mesh), killed at step 3 after the step-2
  checkpoint, rerun: the same metrics, the same exported weights, the same checksums of every state leaf
  (parameters, Adam moments, step, key) at steps 2 and 4."""
  assert resume["devices"]["mesh"] == {"data": 2, "model": 4} and resume["devices"]["device_count"] == 8
  assert resume["saved_before_kill"] == ["2"]
  assert resume["modes"] == ["fixed", "student"]
  assert resume["records_equal"] and resume["export_bit_equal"] and resume["state_sums_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, embedding_shard, devices", [("data=2,model=4", [32, 32], [8]),
                                                            ("model=8", [16, 64], [8]), ("", [128, 64], [1])])
def test_a_checkpoint_restores_onto_another_mesh_shape_with_the_same_bits(resume, mesh, embedding_shard, devices):
  restored = resume["restored"][mesh]
  assert restored["verified"] and restored["bit_equal"] and restored["same_layout_as_template"]
  assert restored["embedding_shard"] == embedding_shard and restored["num_devices"] == devices


@pytest.mark.slow
def test_a_run_restored_onto_another_mesh_shape_trains_on(resume):
  """The killed data=2,model=4 run continued on model=8 from its step-2 checkpoint: it trains (its weights
  move) to the uninterrupted run's result up to float rounding."""
  continued = resume["continued"]
  assert continued["devices"]["mesh"] == {"data": 1, "model": 8}
  assert continued["train_steps_recorded"] == [1, 2, 3, 4]
  assert continued["moved_since_restore"] > 1e-4
  assert continued["export_max_diff"] < 1e-4
  assert continued["after"]["loss"] == pytest.approx(continued["whole_after"]["loss"], rel=1e-4)


@pytest.mark.parametrize("case, message", [
    ("accum", "config.accum_steps 3 does not divide config.data.batch_size 8"),
    ("accum_zero", "config.data.batch_size and config.accum_steps must be >= 1, got 8 and 0"),
    ("micro_batch", "config.data.batch_size 8 / accum_steps 2 = 4 rows per micro-batch do not split over the "
     "mesh's data axis of size 8: use a batch size that is a multiple of accum_steps x 8 = 16"),
    ("batch", "config.data.batch_size 4 / accum_steps 1 = 4 rows per micro-batch do not split over the mesh's "
     "data axis of size 8"),
    ("axis_name", "config.mesh 'data=2,tensor=4': 'tensor=4' is not AXIS=SIZE with AXIS one of ('data', 'model')"),
    ("product", "config.mesh 'data=2,model=2' has 4 devices (2 x 2), but 8 are present")
])
def test_bad_settings_fail_with_one_line_before_anything_loads(case, message):
  """`train.run` on a target that does not exist: the config error comes first."""
  error = _worker("errors")[case]["error"]
  assert error.startswith(message) and "\n" not in error


def test_a_fitting_mesh_setting_passes_the_checks():
  assert _worker("errors")["fits"] == {"returned": True}
