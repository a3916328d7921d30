"""Runs the distillation checks that need several devices in a process of its own, with 8 simulated CPU
devices, and prints one JSON object of results; `tests/test_distill_mesh.py` starts it (the rest of the
suite keeps one device).

  python tests/helpers/distill_mesh_worker.py steps|errors|resume DIR
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# The repository root first on the path, and this directory off it: its gguf.py and tokenizers.py would
# shadow those packages.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(os.path.dirname(_HERE))] + [p for p in sys.path if os.path.abspath(p) != _HERE]

import json  # noqa: E402
import shutil  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from specjax import mesh as meshes, partitioning  # noqa: E402
from specjax.distill import log, steps, student, train  # noqa: E402
from specjax.distill.checkpoint import Checkpointer  # noqa: E402
from specjax.distill.config import default_config  # noqa: E402
from specjax.errors import ConfigError  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.load import load_model  # noqa: E402
from specjax.models.transformer import init_params  # noqa: E402

# Every unit splits on every mesh used: 8 query heads, 128 MLP units and vocabulary rows over model (up to 8),
# the residual width 64 over data (up to 8); the 4 key/value heads split over model=4, not model=8 (replicated).
TEACHER = ModelConfig(arch="llama", vocab_size=128, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8,
                      d_ff=128, attention_block=0)
B, T, NUM_STEPS = 8, 16, 3


def _teacher_params():
  """Random float32 teacher weights (std 0.1 on matrices, so that the logits are far from uniform)."""
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: init_params(TEACHER, jax.random.key(0)))
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: np.asarray(
          rng.normal(0.0, 0.1, leaf.shape)
          if leaf.ndim == 2 else np.full(leaf.shape, 1.0 if path[-1].key == "scale" else 0.0), np.float32), shapes)


def _batches():
  """NUM_STEPS batches [B, T]; row r of batch s keeps T - r - s valid tokens (uneven masks: micro-batches
  hold different token counts, so a mean of micro-batch means would differ from the batch's mean)."""
  rng = np.random.default_rng(1)
  out = []
  for s in range(NUM_STEPS):
    tokens = rng.integers(0, TEACHER.vocab_size, (B, T)).astype(np.int32)
    mask = np.arange(T)[None, :] < (T - np.arange(B) - s)[:, None]
    out.append((tokens, mask))
  return out


SGD_LR = 0.5


def _optimizer(name: str, labels):
  """("adamw": the runs' optimizer, lr 1e-2 without warmup; "sgd": plain gradient descent, whose update
  is the gradient itself, so that parameters compare as tightly as gradients do: Adam's first steps
  divide each gradient element by its own magnitude, and elements whose gradient is near zero (below
  the rounding of the sums that make it) then move by an amount that rounding decides."""
  if name == "sgd":
    return (optax.multi_transform({student.TRAIN: optax.sgd(SGD_LR), student.FROZEN: optax.set_to_zero()},
                                  labels), lambda step: jnp.float32(SGD_LR))
  optim = default_config().optim
  optim.learning_rate, optim.warmup_steps = 1e-2, 0  # every step moves the weights
  return steps.make_optimizer(optim, 10, labels)


def _train(spec: str, accum_steps: int = 1, remat: bool = False, keep_state: bool = False, optim: str = "sgd",
           jaxpr: bool = False):
  """NUM_STEPS train steps of the 1-layer truncated student on mesh `spec` ("" = one device): (host params,
  [loss], [grad norm], state if `keep_state`); with `jaxpr`, the text of the step's jaxpr instead."""
  config = default_config()
  config.mesh = spec
  mesh = meshes.make_mesh(spec)
  teacher_part = state_part = compute_part = None
  if mesh is not None:
    teacher_part = partitioning.Partitioning(mesh, partitioning.DECODE_RULES, name="target")
    state_part = partitioning.Partitioning(mesh, partitioning.FSDP_RULES, name="student")
    compute_part = partitioning.Partitioning(mesh, partitioning.DECODE_RULES, name="student")
  teacher_params = partitioning.shard_params(TEACHER, jax.tree.map(jnp.asarray, _teacher_params()), teacher_part)
  student_config, params = student.truncate(TEACHER, teacher_params, 1)
  params = partitioning.shard_params(student_config, params, state_part)
  labels = student.frozen_labels(student_config, params, False, False, ())
  optimizer, schedule = _optimizer(optim, labels)
  state, place = train.initial_state(config, student_config, params, optimizer, teacher_params,
                                     (teacher_part, state_part, compute_part))
  train_step = steps.make_train_step(TEACHER, student_config.replace(remat=remat), steps.Optimizer(optimizer, schedule),
                                     labels, config.loss, accum_steps, place)
  if jaxpr:
    return str(jax.make_jaxpr(train_step)(state, teacher_params, *_batches()[0]))
  losses, norms = [], []
  for tokens, mask in _batches():
    state, metrics = train_step(state, teacher_params, steps.put_rows(tokens, place), steps.put_rows(mask, place))
    metrics = meshes.to_host(metrics)
    losses.append(float(metrics["loss"]))
    norms.append(float(metrics["grad_norm"]))
  return meshes.to_host(state.params), losses, norms, state if keep_state else None


def _max_diff(a, b) -> float:
  return max(
      float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _bit_equal(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _shards(tree) -> dict:
  """{key path: shape of the shard on the first device} of every array leaf."""
  return {
      jax.tree_util.keystr(path): list(leaf.addressable_shards[0].data.shape)
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
      if leaf.ndim
  }


def steps_() -> dict:
  """Sharded, accumulated and rematerialised steps against one device's plain steps."""
  base_params, base_losses, base_norms, _ = _train("")
  initial = _initial_params()
  results = {"base": {"losses": base_losses, "grad_norms": base_norms}, "sgd_lr": SGD_LR}
  variants = {
      "data=2,model=4": ("data=2,model=4", 1, False), "model=8": ("model=8", 1, False), "data=8": ("data=8", 1, False),
      "accum2": ("", 2, False), "accum4": ("", 4, False), "data=2,model=4|accum2": ("data=2,model=4", 2, False),
      "remat": ("", 1, True), "data=2,model=4|remat": ("data=2,model=4", 1, True)
  }
  kept = {}
  for name, (spec, accum, remat) in variants.items():
    params, losses, norms, _ = _train(spec, accum, remat)
    kept[name] = params
    results[name] = {
        "param_diff": _max_diff(params, base_params), "losses": losses, "grad_norms": norms,
        "moved": _max_diff(params, initial)
    }
  # AdamW (the runs' optimizer): one device and data=2,model=4; the sharded state's shard shapes.
  adam_params, adam_losses, adam_norms, _ = _train("", optim="adamw")
  params, losses, norms, state = _train("data=2,model=4", keep_state=True, optim="adamw")
  diffs = np.concatenate([
      np.abs(np.asarray(a) - np.asarray(b)).ravel()
      for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(adam_params))
  ])
  results["adamw"] = {
      "base_losses": adam_losses, "base_grad_norms": adam_norms, "losses": losses, "grad_norms": norms,
      "param_diff": float(diffs.max()), "elements_beyond_1e-6": int(np.sum(diffs > 1e-6)), "elements": int(diffs.size),
      "moved": _max_diff(params, initial)
  }
  results["shards"] = {
      "params": _shards(state.params), "opt_state": _shards(state.opt_state),
      "devices": sorted({d.id for leaf in jax.tree.leaves(state.params) for d in leaf.sharding.device_set})
  }
  for name, (accum, remat) in {"plain": (1, False), "remat": (1, True), "accum2": (2, False)}.items():
    text = _train("", accum, remat, jaxpr=True)
    results[f"jaxpr_{name}"] = {
        "checkpoints": text.count("remat2["), "scans": text.count("scan["), "length=2": text.count("length=2")
    }
  results["remat_bit_equal"] = _bit_equal(kept["remat"], base_params)
  results["mesh_remat_bit_equal"] = _bit_equal(kept["data=2,model=4|remat"], kept["data=2,model=4"])
  results["mesh_remat_diff"] = _max_diff(kept["data=2,model=4|remat"], kept["data=2,model=4"])
  return results


def _initial_params():
  _, params = student.truncate(TEACHER, jax.tree.map(jnp.asarray, _teacher_params()), 1)
  return jax.device_get(params)


def errors() -> dict:
  """The message of each bad config, raised by `train.run` before it reads data, loads or compiles
  anything (the target does not even exist)."""
  cases = {
      "accum": dict(accum_steps=3), "micro_batch": dict(mesh="data=8", accum_steps=2),
      "batch": dict(mesh="data=-1,model=1",
                    batch_size=4), "axis_name": dict(mesh="data=2,tensor=4"), "product": dict(mesh="data=2,model=2"),
      "accum_zero": dict(accum_steps=0), "fits": dict(mesh="data=2,model=4", accum_steps=2)
  }
  results = {}
  for name, changes in cases.items():
    config = default_config()
    config.target, config.workdir = "/nonexistent/target", "/nonexistent/workdir"
    config.data.batch_size = changes.pop("batch_size", 8)
    for key, value in changes.items():
      config[key] = value
    try:
      train.check_config(config) if name == "fits" else train.run(config)
      results[name] = {"returned": True}
    except ConfigError as e:
      results[name] = {"error": str(e)}
  return results


def _save_target(directory: str) -> str:
  """TEACHER as a Hugging Face directory with the tiny character tokenizer (97 ids inside 128 rows)."""
  import transformers

  from tests.helpers.distill import tiny_tokenizer

  config = transformers.LlamaConfig(vocab_size=TEACHER.vocab_size, hidden_size=TEACHER.d_model,
                                    intermediate_size=TEACHER.d_ff, num_hidden_layers=TEACHER.n_layers,
                                    num_attention_heads=TEACHER.n_heads, num_key_value_heads=TEACHER.n_kv_heads,
                                    head_dim=TEACHER.head_dim, max_position_embeddings=256, rms_norm_eps=1e-6,
                                    tie_word_embeddings=False, eos_token_id=0, bos_token_id=None)
  transformers.set_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config)
  for p in model.parameters():
    if p.ndim == 2:
      p.data.normal_(0.0, 0.1)
  model.save_pretrained(directory)
  tiny_tokenizer().save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|endoftext|>", "unk_token": "<unk>"}, f)
  return directory


def _run_config(target: str, workdir: str, spec: str, **changes):
  from configs import distill_tiny

  config = distill_tiny.get_config()
  config.target, config.workdir, config.mesh = target, workdir, spec
  config.num_steps, config.checkpoint_every, config.eval_every, config.eval_batches = 4, 2, 4, 1
  config.optim.warmup_steps = 0
  config.data.max_train_tokens, config.data.max_heldout_tokens = 4_000, 600
  config.data.modes.student = 0.5  # on-policy batches generated on the mesh too
  for key, value in changes.items():
    config[key] = value
  return config


class _Crash(Exception):
  pass


def _export(summary) -> dict:
  from safetensors.numpy import load_file
  return load_file(os.path.join(summary["export_dir"], "model.safetensors"))


def _records(workdir):
  with open(os.path.join(workdir, log.METRICS_FILE)) as f:
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in f]


def resume(directory: str) -> dict:
  """train.run on data=2,model=4: uninterrupted, and killed at step 3 then rerun (bit for bit the same);
  the killed run's checkpoint (step 2) restored onto model=8 and one device (the same bits), and
  continued on model=8 to the end (the same run up to float rounding)."""
  jax.config.update("jax_compilation_cache_dir", os.path.join(directory, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  target = _save_target(os.path.join(directory, "target"))
  mesh = "data=2,model=4"
  whole = train.run(_run_config(target, os.path.join(directory, "whole"), mesh))

  def crash(step, metrics):
    if step == 3:
      raise _Crash()

  killed = os.path.join(directory, "killed")
  try:
    train.run(_run_config(target, killed, mesh), on_step=crash)
    raise AssertionError("the run was not interrupted")
  except _Crash:
    pass
  saved = sorted(os.listdir(os.path.join(killed, train.CHECKPOINT_DIR)))
  moved = os.path.join(directory, "moved")
  shutil.copytree(killed, moved)
  resumed = train.run(_run_config(target, killed, mesh))
  results = {
      "saved_before_kill": saved,
      "state_sums_equal": _state_sums(whole_dir := os.path.join(directory, "whole"), 4) == _state_sums(killed, 4)
                          and _state_sums(whole_dir, 2) == _state_sums(killed, 2),
      "modes": sorted({r["mode"] for r in _records(killed) if "mode" in r}
                     ), "records_equal": _records(killed) == _records(os.path.join(directory, "whole")),
      "export_bit_equal": _bit_equal(_export(whole), _export(resumed)), "export_keys": sorted(_export(whole)),
      "devices": whole["devices"]
  }

  # The killed run's step-2 checkpoint, restored with templates laid out for each mesh.
  restored = {}
  for spec in (mesh, "model=8", ""):
    config = _run_config(target, moved, spec)
    parts = train._parts(config)
    teacher = load_model(target, config.dtype, parts[0])
    student_config, params = train.init_student(config, teacher, parts[1])
    labels = student.frozen_labels(student_config, params, False, False, ())
    optimizer, _ = steps.make_optimizer(config.optim, config.num_steps, labels)
    template, _ = train.initial_state(config, student_config, params, optimizer, teacher.params, parts)
    checkpoints = Checkpointer(os.path.join(moved, train.CHECKPOINT_DIR), 2, read_only=True)
    try:
      state, _, verified = checkpoints.restore(2, template)
    finally:
      checkpoints.close()
    restored[spec] = (state, verified, jax.tree.map(lambda leaf: leaf.sharding, template))
  reference = meshes.to_host(restored[mesh][0])
  results["restored"] = {
      spec: {
          "verified": verified, "bit_equal": _bit_equal(meshes.to_host(state), reference),
          "same_layout_as_template": all(a.sharding == b
                                         for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(shardings))),
          "num_devices": sorted({len(leaf.sharding.device_set)
                                 for leaf in jax.tree.leaves(state)}),
          "embedding_shard": list(state.params["embed"]["embedding"].addressable_shards[0].data.shape)
      } for spec, (state, verified, shardings) in restored.items()
  }

  # Continue the killed run on another mesh shape.
  continued = train.run(_run_config(target, moved, "model=8"))
  got, want = _export(continued), _export(whole)
  results["continued"] = {
      "train_steps_recorded": [r["step"] for r in _records(moved) if r["split"] == "train"],
      "export_max_diff": max(float(np.max(np.abs(got[k] - want[k]))) for k in want), "moved_since_restore": float(
          np.max(
              np.abs(got["model.embed_tokens.weight"] - meshes.to_host(restored[mesh][0].params["embed"]["embedding"])))
      ), "after": continued["after"], "whole_after": whole["after"], "devices": continued["devices"]
  }
  return results


def _state_sums(workdir: str, step: int) -> dict:
  """The SHA-256 of every leaf of checkpoint `step`'s train state (params, Adam moments, step, key), as
  recorded at save time."""
  import orbax.checkpoint as ocp

  from specjax.distill import checkpoint
  saved = Checkpointer(os.path.join(workdir, train.CHECKPOINT_DIR), 2, read_only=True)
  try:
    return saved.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta[checkpoint.STATE_SUMS]
  finally:
    saved.close()


if __name__ == "__main__":
  name = {"steps": "steps_"}.get(sys.argv[1], sys.argv[1])
  print(json.dumps(globals()[name](*sys.argv[2:])))
