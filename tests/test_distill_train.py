"""The distillation run on a tiny target: it learns, it resumes bit for bit, it stops on NaN, it refuses
bad configs clearly, and the CLI drives it.

Each run compiles a train step, an eval step and generate loops; the test run's persistent compilation
cache (tests/conftest.py) lets the later runs, and the CLI's processes, reuse the first run's programs.
"""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import transformers
from safetensors.numpy import load_file

from specjax.distill import checkpoint, log, train
from specjax.models.load import load_model
from tests.helpers.distill import Crash, distill_config, read_records, tiny_tokenizer
from tests.helpers.distill import target  # noqa: F401 (the fixture)


def test_loss_falls_and_heldout_acceptance_rises(target, tmp_path):
  summary = train.run(distill_config(target, tmp_path))
  records = read_records(tmp_path)
  losses = [r["loss"] for r in records if r["split"] == "train"]
  assert len(losses) == 40 and [r["step"] for r in records if r["split"] == "eval"] == [0, 20, 40]
  assert np.mean(losses[-10:]) < 0.75 * np.mean(losses[:10])
  assert summary["after"]["acceptance"] > summary["before"]["acceptance"] + 0.03
  assert summary["after"]["greedy_agreement"] > summary["before"]["greedy_agreement"]
  assert summary["after"]["loss"] < summary["before"]["loss"]
  with open(tmp_path / train.SUMMARY_FILE) as f:
    assert json.load(f)["acceptance_gain"] == pytest.approx(summary["acceptance_gain"])
  with open(tmp_path / log.METRICS_FILE) as f:
    raw = [json.loads(line) for line in f]
  assert all(
      r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["learning_rate"] >= 0 for r in raw if r["split"] == "train")
  draft = load_model(summary["export_dir"])
  assert draft.config.n_layers == 1 and draft.config.vocab_size == load_model(target).config.vocab_size


def _tensorboard_scalars(workdir, split):
  """({(tag, step): value} as TensorBoard shows the run `split`, [steps of its purge markers]): event
  files read in the order written, a SessionLog START at step s hiding every earlier event at a step >= s."""
  import struct

  from tensorboardX.proto import event_pb2

  def events(name):
    with open(os.path.join(directory, name), "rb") as f:
      data = f.read()
    offset, events = 0, []
    while offset < len(data):  # TFRecord: length (8 bytes), its CRC (4), the record, its CRC (4)
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      events.append(event_pb2.Event.FromString(data[offset + 12:offset + 12 + length]))
      offset += 16 + length
    return events

  directory = os.path.join(workdir, "tensorboard", split)
  scalars, purges = {}, []
  for file_events in map(events, sorted(os.listdir(directory))):  # TensorBoard reads them in name order
    for event in file_events:
      if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
        scalars = {key: v for key, v in scalars.items() if key[1] < event.step}
        purges.append(event.step)
      for value in event.summary.value:
        scalars[(value.tag, event.step)] = value.simple_value
  return scalars, purges


def _jsonl_scalars(workdir, split):
  """metrics.jsonl's numeric fields of `split` as float32, keyed like `_tensorboard_scalars`."""
  with open(os.path.join(workdir, log.METRICS_FILE)) as f:
    records = [r for line in f if (r := json.loads(line))["split"] == split]
  return {(k, r["step"]): float(np.float32(v))
          for r in records for k, v in r.items() if k not in ("step", "split", "mode")}


@pytest.mark.slow
def test_interrupted_run_resumes_bit_identical(target, tmp_path):
  """On-policy batches mixed in (draft-generated continuations sampled with per-step keys from the
  current params), killed between checkpoints, rerun: the same params, metrics and evaluations as an
  uninterrupted run; the resumed run's TensorBoard scalars show exactly its metrics.jsonl (what the
  killed run logged after its checkpoint is purged)."""
  changes = dict(data__modes__student=1.0, tensorboard=True)  # the tiny config checkpoints every 10 steps
  whole = train.run(distill_config(target, tmp_path / "whole", **changes))

  def crash(step, metrics):
    if step == 15:
      raise Crash()

  with pytest.raises(Crash):
    train.run(distill_config(target, tmp_path / "resumed", **changes), on_step=crash)
  assert sorted(os.listdir(tmp_path / "resumed" / train.CHECKPOINT_DIR)) == ["10"]
  assert max(r["step"] for r in read_records(tmp_path / "resumed")) == 15
  resumed = train.run(distill_config(target, tmp_path / "resumed", **changes))

  modes = {r["mode"] for r in read_records(tmp_path / "whole") if r["split"] == "train"}
  assert modes == {"fixed", "student"}
  assert read_records(tmp_path / "resumed") == read_records(tmp_path / "whole")
  assert resumed["after"] == whole["after"]
  want = load_file(os.path.join(whole["export_dir"], "model.safetensors"))
  got = load_file(os.path.join(resumed["export_dir"], "model.safetensors"))
  assert want.keys() == got.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  _, draft, step = train.latest(distill_config(target, tmp_path / "resumed", **changes))
  assert step == 40
  for split, purge_from in (("train", 11), ("eval", 10)):  # metrics.jsonl's cut after resuming at step 10
    shown, purges = _tensorboard_scalars(tmp_path / "resumed", split)
    assert purges == [purge_from]
    assert shown == _jsonl_scalars(tmp_path / "resumed", split)
    assert {tag for tag, _ in shown} >= ({"loss", "grad_norm", "learning_rate"}
                                         if split == "train" else {"loss", "acceptance", "greedy_agreement"})
  np.testing.assert_array_equal(draft.params["embed"]["embedding"], want["model.embed_tokens.weight"])


@pytest.mark.slow
def test_bfloat16_run_checkpoints_a_float32_master_and_resumes_bit_identical(target, tmp_path):
  """A bfloat16 run (on-policy batches from the bfloat16 draft) killed after its first checkpoint resumes
  to the uninterrupted run's metrics and export; its checkpoints hold float32 params and moments, and the
  export is the master rounded to bfloat16 (the draft that was evaluated)."""
  changes = dict(dtype="bfloat16", num_steps=6, checkpoint_every=2, eval_every=6, data__modes__student=0.5)
  whole = train.run(distill_config(target, tmp_path / "whole", **changes))

  def crash(step, metrics):
    if step == 3:
      raise Crash()

  with pytest.raises(Crash):
    train.run(distill_config(target, tmp_path / "resumed", **changes), on_step=crash)
  resumed = train.run(distill_config(target, tmp_path / "resumed", **changes))
  assert read_records(tmp_path / "resumed") == read_records(tmp_path / "whole")
  assert {r["mode"] for r in read_records(tmp_path / "whole") if r["split"] == "train"} == {"fixed", "student"}
  want = load_file(os.path.join(whole["export_dir"], "model.safetensors"))
  got = load_file(os.path.join(resumed["export_dir"], "model.safetensors"))
  assert want.keys() == got.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_array_equal(got[name].astype(ml_dtypes.bfloat16).astype(np.float32), got[name])
  saved = checkpoint.Checkpointer(str(tmp_path / "resumed" / train.CHECKPOINT_DIR), 2, read_only=True)
  try:
    sums = saved.manager.restore(6, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta[checkpoint.STATE_SUMS]
  finally:
    saved.close()
  assert {r["dtype"] for name, r in sums.items() if name.startswith((".params", ".opt_state")) and r["shape"]
         } == {"float32"}
  _, draft, step = train.latest(distill_config(target, tmp_path / "resumed", **changes))
  assert step == 6 and draft.config.dtype == "bfloat16"
  np.testing.assert_array_equal(np.asarray(draft.params["embed"]["embedding"], np.float32),
                                want["model.embed_tokens.weight"])


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(target, tmp_path):
  config = distill_config(target, tmp_path, optim__learning_rate=1e30, optim__warmup_steps=0, checkpoint_every=1)
  with pytest.raises(FloatingPointError, match=r"non-finite .* at step 2; .*last good checkpoint is step 1"):
    train.run(config)
  assert os.listdir(tmp_path / train.CHECKPOINT_DIR) == ["1"]


def _other_vocab_draft(directory):
  """A draft whose vocabulary (50 ids) is not the target's (97), with the target's tokenizer file."""
  config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
  tiny_tokenizer().save(os.path.join(directory, "tokenizer.json"))
  return directory


_BAD_CONFIGS = {  # case -> (config changes given tmp_path, error, message)
    "divergence": (lambda tmp: {"loss__divergence": "hellinger"}, ValueError, "unknown divergence 'hellinger'"),
    "vocabulary": (lambda tmp: {"student__init": "checkpoint",
                                "student__checkpoint": _other_vocab_draft(str(tmp / "d"))},
                   ValueError, r"vocabulary \(50 ids\) != teacher vocabulary \(97 ids\)"),
    "empty data": (lambda tmp: {"data__source": str(tmp)}, ValueError, "no non-empty documents"),
    "student init": (lambda tmp: {"student__init": "distil"}, ValueError, "unknown student.init 'distil'"),
    "workdir": (lambda tmp: {"workdir": str(tmp / "a_file" / "work")}, PermissionError,
                "cannot be created or written"),
}


@pytest.mark.parametrize("case", sorted(_BAD_CONFIGS))
def test_bad_configs_give_clear_errors(case, target, tmp_path):
  (tmp_path / "a_file").write_text("")  # a workdir below a file cannot be created (even by root)
  changes, error, message = _BAD_CONFIGS[case]
  with pytest.raises(error, match=message):
    train.run(distill_config(target, tmp_path / "work", **changes(tmp_path)))


@pytest.mark.slow
def test_cli_runs_resumes_and_reports_errors(target, tmp_path):
  command = [
      sys.executable, "-m", "specjax.distill", "--config=configs/distill_tiny.py", f"--config.workdir={tmp_path}",
      f"--config.target={target}"
  ]
  env = dict(os.environ)  # with the test run's compilation cache (tests/conftest.py)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cli = lambda *extra: subprocess.run(command + list(extra), cwd=root, env=env, capture_output=True, text=True)
  done = cli()
  assert done.returncode == 0, done.stderr
  assert "held-out acceptance" in done.stdout and (tmp_path / train.SUMMARY_FILE).exists()
  again = cli()  # a finished run resumes at its last step: it re-evaluates and re-exports only
  assert again.returncode == 0, again.stderr
  assert "resuming from step 40" in again.stdout and "step     40/40" not in again.stdout
  bad = cli("--config.loss.divergence=l2")  # a config value: a usage error, exit status 2
  assert bad.returncode == 2 and bad.stderr.strip() == (
      "error: config.loss: unknown divergence 'l2'; expected one of ('forward_kl', 'reverse_kl', 'jsd', 'tvd')")
  unknown = cli("--config.student.nm_layers=2")
  assert unknown.returncode == 2 and unknown.stderr.strip().startswith(
      "error: unknown config field 'student.nm_layers' (did you mean 'student.num_layers'?); known fields of "
      "'student': ")
  missing = cli(f"--config.target={tmp_path / 'no-model'}")  # data: exit status 1
  assert missing.returncode == 1 and missing.stderr.startswith("error: ") and "no-model" in missing.stderr
  assert "Traceback" not in bad.stderr + unknown.stderr + missing.stderr


def test_smollm2_report_prepares_both_drafts_and_the_prompts(target, tmp_path):
  """experiments/distill_smollm2/report.prepare on a tiny run: drafts/step0 is the undistilled
  (truncated) draft, drafts/step<N> the checkpoint's, both loadable; prompts come from held-out files."""
  from experiments.distill_smollm2 import report

  config = distill_config(target, tmp_path, num_steps=10)
  summary = train.run(config)
  paths = report.prepare(config, num_prompts=3, prompt_tokens=8)
  assert paths["checkpoint_step"] == 10
  teacher = load_model(target)
  _, init_params = train.init_student(config, teacher)
  undistilled, distilled = load_model(paths["undistilled"]), load_model(paths["distilled"])
  assert paths["distilled"].endswith(os.path.join("drafts", "step10"))
  for got, want in zip(jax.tree.leaves(undistilled.params), jax.tree.leaves(init_params)):
    np.testing.assert_array_equal(got, want)
  final = load_file(os.path.join(summary["export_dir"], "model.safetensors"))
  np.testing.assert_array_equal(distilled.params["embed"]["embedding"], final["model.embed_tokens.weight"])
  assert not np.array_equal(distilled.params["embed"]["embedding"], init_params["embed"]["embedding"])
  with open(paths["prompts_file"]) as f:
    prompts = [json.loads(line)["prompt"] for line in f]
  _, held = report.split(config)
  assert len(prompts) == 3 and all(any(doc.text.startswith(p) for doc in held) for p in prompts)
