"""Distillation checkpoints are checked: a truncated, bit-flipped or partly missing checkpoint is reported by
step and path and skipped for the newest good one (bit for bit the same run), or refused on request; a
checkpoint of another config is not mistaken for a damaged one; a NaN names the step and the checkpoint
the run restored.

The damage is done to copies of one finished short run (checkpoints at steps 2 and 4).
"""

import gc
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file

from specjax.distill import checkpoint, train
from specjax.distill.checkpoint import CorruptCheckpointError
from tests.helpers.distill import distill_config, read_records
from tests.helpers.distill import target  # noqa: F401 (the fixture)

# A failed orbax restore abandons its other read coroutines: harmless, but pytest reports each one as an
# unraisable exception when it is collected. `_collect_abandoned_reads` collects them within the test that
# caused them, where this filter applies.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _collect_abandoned_reads():
  yield
  gc.collect()


_SHORT = {"num_steps": 4, "checkpoint_every": 2, "eval_every": 4}  # checkpoints 2 and 4, evals 0 and 4


@pytest.fixture(scope="module")
def finished(target, tmp_path_factory):
  """(workdir, metrics records, exported tensors) of an uninterrupted short run; tests damage copies."""
  workdir = tmp_path_factory.mktemp("finished")
  summary = train.run(distill_config(target, workdir, **_SHORT))
  return str(workdir), read_records(workdir), load_file(os.path.join(summary["export_dir"], "model.safetensors"))


def _copy(finished, tmp_path):
  """A copy of the finished run's workdir, and its checkpoints directory."""
  workdir = str(tmp_path / "work")
  shutil.copytree(finished[0], workdir)
  return workdir, os.path.join(workdir, train.CHECKPOINT_DIR)


def _largest_state_file(checkpoints, step):
  """The biggest file of checkpoint `step`'s state item: OCDBT data holding array chunks."""
  files = [
      f for f in glob.glob(os.path.join(checkpoints, str(step), "state", "**"), recursive=True) if os.path.isfile(f)
  ]
  return max(files, key=os.path.getsize)


def _truncate(checkpoints, step):
  path = _largest_state_file(checkpoints, step)
  os.truncate(path, os.path.getsize(path) // 2)


def _flip(checkpoints, step):
  """Inverts 8 bytes in the middle of the state's largest data file."""
  path = _largest_state_file(checkpoints, step)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    data = f.read(8)
    f.seek(-8, os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in data))


def _remove(checkpoints, step):
  os.remove(_largest_state_file(checkpoints, step))


def _edit_metadata(checkpoints, step):
  """Moves the recorded data position by one (still valid JSON)."""
  path = os.path.join(checkpoints, str(step), "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  meta["data"]["position"] += 1
  with open(path, "w") as f:
    json.dump(meta, f)


def _raw_state(checkpoints, step):
  """Checkpoint `step`'s state leaves as orbax alone restores them (no verification)."""
  options = ocp.CheckpointManagerOptions(read_only=True, create=False)
  manager = ocp.CheckpointManager(checkpoints, options=options)
  state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
  manager.close()
  return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


def test_truncated_latest_checkpoint_falls_back_bit_identical(finished, target, tmp_path, capsys):
  workdir, checkpoints = _copy(finished, tmp_path)
  _truncate(checkpoints, 4)
  summary = train.run(distill_config(target, workdir, **_SHORT))
  out, err = capsys.readouterr()
  step4 = os.path.join(checkpoints, "4")
  assert re.search(
      rf"warning: checkpoint step 4 in {re.escape(step4)} is damaged: file state/\S+ has \d+ bytes, "
      r"\d+ were saved; trying step 2\n", err)
  assert f"warning: set the damaged checkpoint aside as {step4}.damaged;" in err
  assert f"resuming from step 2 ({os.path.join(checkpoints, '2')})" in out
  assert sorted(os.listdir(checkpoints)) == ["2", "4", "4.damaged"]
  assert read_records(workdir) == finished[1]
  got = load_file(os.path.join(summary["export_dir"], "model.safetensors"))
  assert got.keys() == finished[2].keys()
  for name in got:
    np.testing.assert_array_equal(got[name], finished[2][name], err_msg=name)
  assert train.latest(distill_config(target, workdir, **_SHORT))[2] == 4  # the new step 4 verifies
  assert "warning: checkpoint" not in capsys.readouterr().err


_DAMAGES = {  # damage -> (harm, reason found by the file manifest, reason found by orbax and the leaf sums)
    "truncated": (_truncate, r"file state/\S+ has \d+ bytes, \d+ were saved", r"its state cannot be read \("),
    "flipped": (_flip, r"file state/\S+ does not match its checksum", "checksum mismatch in "),
    "missing file": (_remove, r"file state/\S+ is missing", r"its state cannot be read \("), "edited metadata":
        (_edit_metadata, "file meta/metadata does not match its checksum", "its metadata does not match its checksum")
}


def _drop_manifest(checkpoints, step):
  """As if the run had stopped before the save finished (or an older version wrote it)."""
  os.remove(os.path.join(checkpoints, str(step), checkpoint.FILES))


@pytest.mark.parametrize("manifest", [True, False])
@pytest.mark.parametrize("damage", sorted(_DAMAGES))
def test_damage_is_detected_and_skipped_read_only(damage, manifest, finished, target, tmp_path, capsys):
  """`train.latest` (read-only) skips the damaged step 4 for step 2 and leaves it in place. With its
  file manifest the damage is found before orbax reads anything; without it, by orbax's error or the
  checksums of the restored leaves."""
  workdir, checkpoints = _copy(finished, tmp_path)
  harm, by_manifest, by_leaves = _DAMAGES[damage]
  reason = by_manifest if manifest else by_leaves
  if not manifest:
    _drop_manifest(checkpoints, 4)
  harm(checkpoints, 4)
  if damage == "flipped":  # orbax alone restores the flipped data without complaint, but not as saved
    good = _raw_state(os.path.join(finished[0], train.CHECKPOINT_DIR), 4)
    assert any(not np.array_equal(a, b) for a, b in zip(_raw_state(checkpoints, 4), good))
  _, _, step = train.latest(distill_config(target, workdir, **_SHORT))
  assert step == 2
  err = capsys.readouterr().err
  assert re.search(
      f"warning: checkpoint step 4 in {re.escape(os.path.join(checkpoints, '4'))} is damaged: "
      f"{reason}", err), err
  assert sorted(os.listdir(checkpoints)) == ["2", "4"]


def test_refuse_option_stops_on_a_damaged_checkpoint(finished, target, tmp_path):
  workdir, checkpoints = _copy(finished, tmp_path)
  _flip(checkpoints, 4)
  step4 = os.path.join(checkpoints, "4")
  with pytest.raises(
      CorruptCheckpointError, match=rf"^checkpoint step 4 in {re.escape(step4)} is damaged: "
      r"file state/\S+ does not match its checksum; not falling back to an older checkpoint") as error:
    train.run(distill_config(target, workdir, on_damaged_checkpoint="refuse", **_SHORT))
  assert (error.value.step, error.value.path) == (4, step4)
  assert sorted(os.listdir(checkpoints)) == ["2", "4"]


def test_all_damaged_refuses_to_restart_from_scratch(finished, target, tmp_path, capsys):
  workdir, checkpoints = _copy(finished, tmp_path)
  _truncate(checkpoints, 4)
  _flip(checkpoints, 2)
  with pytest.raises(CorruptCheckpointError, match=rf"every checkpoint in {re.escape(checkpoints)} is damaged "
                     r"\(steps 4, 2;"):
    train.latest(distill_config(target, workdir, **_SHORT))
  err = capsys.readouterr().err
  assert "step 4" in err and "; trying step 2\n" in err and "no older checkpoint\n" in err


def test_unverified_old_checkpoint_restores_with_a_warning(finished, target, tmp_path, capsys):
  """A checkpoint saved before checksums existed (its JSON item without them) is trusted, with a warning."""
  workdir, checkpoints = _copy(finished, tmp_path)
  path = os.path.join(checkpoints, "4", "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  _drop_manifest(checkpoints, 4)
  del meta[checkpoint.STATE_SUMS], meta[checkpoint.JSON_SUM]
  with open(path, "w") as f:
    json.dump(meta, f)
  assert train.latest(distill_config(target, workdir, **_SHORT))[2] == 4
  assert (f"warning: checkpoint step 4 in {os.path.join(checkpoints, '4')} has no checksums (saved by an older "
          "version): restored unverified") in capsys.readouterr().err


def test_another_configs_checkpoint_is_not_called_damaged(finished, target, tmp_path):
  """A changed student is a config error: no fallback, nothing set aside."""
  workdir, checkpoints = _copy(finished, tmp_path)
  with pytest.raises(
      ValueError, match=r"checkpoint step 4 in .* holds another train state than this config "
      r"builds \(differing: .*layers_1") as error:
    train.run(distill_config(target, workdir, student__num_layers=2, **_SHORT))
  assert not isinstance(error.value, CorruptCheckpointError)
  assert sorted(os.listdir(checkpoints)) == ["2", "4"]


def test_nan_message_names_the_step_and_the_restored_checkpoint(target, tmp_path):
  config = distill_config(target, tmp_path, optim__learning_rate=1e30, optim__warmup_steps=0, checkpoint_every=1)
  checkpoints = os.path.join(tmp_path, train.CHECKPOINT_DIR)
  step1 = os.path.join(checkpoints, "1")
  with pytest.raises(
      FloatingPointError, match=rf"at step 2; stopping \(this run started from scratch; the last "
      rf"good checkpoint is step 1 in {re.escape(step1)}\)"):
    train.run(config)
  with pytest.raises(
      FloatingPointError, match=rf"at step 2; stopping \(this run resumed from verified checkpoint "
      rf"step 1 in {re.escape(step1)}; the last good checkpoint is step 1 in {re.escape(step1)}\)"):
    train.run(config)


def test_cli_refusing_a_damaged_checkpoint_prints_one_error_line(finished, target, tmp_path):
  """The refusal comes before any training: nothing to compile."""
  workdir, checkpoints = _copy(finished, tmp_path)
  _truncate(checkpoints, 4)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([
      sys.executable, "-m", "specjax.distill", "--config=configs/distill_tiny.py", f"--config.workdir={workdir}",
      f"--config.target={target}", "--config.num_steps=4", "--config.checkpoint_every=2",
      "--config.on_damaged_checkpoint=refuse"
  ], cwd=root, capture_output=True, text=True)
  errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
  assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
  step4 = os.path.join(checkpoints, "4")
  assert len(errors) == 1 and done.stderr.strip().splitlines() == errors, done.stderr  # nothing else
  assert re.match(rf"error: checkpoint step 4 in {re.escape(step4)} is damaged: file state/\S+ has \d+ bytes",
                  errors[0]), errors
