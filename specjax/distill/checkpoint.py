"""Checkpoints that never lose work and are never trusted blindly: an orbax `CheckpointManager` over the
train state and its metadata, with checksums.

One checkpoint per saved step, under `WORKDIR/checkpoints/<step>`: the train state pytree (params,
optimizer state, step, RNG key) via `StandardSave`, and a JSON item (data-stream position and fingerprint,
anything else the loop must resume exactly) via `JsonSave`. Orbax writes each step to a temporary
directory and renames it when complete, so a run killed mid-save leaves the previous checkpoint as the
latest; rerunning the same command restores it. The preservation policy keeps the newest `keep`
checkpoints plus, optionally, every `keep_every`-th step.

Orbax does not verify what it reads back: a truncated or missing data file fails deep inside TensorStore,
and flipped bytes in an array's data are restored silently (its zarr chunks carry no checksum). So each
checkpoint's JSON item also records a SHA-256 of every state leaf (its bytes, with its key path, dtype and
shape), taken at save time from a host copy of the state, and a SHA-256 of the rest of the JSON item; a
restore checks the JSON first, then recomputes the leaves' from the restored arrays. Once a save has
finished (checked when the next save starts, and on `wait`/`close`), the size and SHA-256 of every file
it wrote are recorded in `<step>/files.sha256.json`, and a restore checks them before orbax reads
anything: damage is then found without orbax failing mid-read (whose abandoned reads print tracebacks
from TensorStore's threads long after the error). Any failure to read step N, or any mismatch, is a
`CorruptCheckpointError` naming the step and its directory (and the damaged file when known).
`restore_newest` falls back past damaged checkpoints to the newest good one. Checkpoints written before
checksums were recorded restore with a warning that they are unverified.

Sharded state (a run on a device mesh): orbax writes each array's shards (every process its own,
process 0 the metadata) and restores into the shardings of the template's arrays, so a template laid
out for another mesh shape (or one device) restores the same values onto it. The leaf checksums are of
each array's global bytes in C order, independent of its sharding: a checkpoint saved on one mesh
verifies on any other. They are computed on a host copy of the whole array (`specjax.mesh.to_host`):
in one process that gathers the addressable shards; in several, every process gathers every array
from all of them (a collective: all processes save and restore together, as orbax requires anyway),
so each host needs memory for one copy of the train state at save and restore time. Only process 0
writes the file manifests and sets damaged checkpoints aside (the step directories are on a file
system every process sees). The multi-process path is untested (CI has one process).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as ocp_policy

from specjax import mesh as meshes

FILES = "files.sha256.json"  # in each step directory once its save finished: {relative path: [size, sha256]}
DAMAGED_SUFFIX = ".damaged"  # a damaged checkpoint set aside is renamed <step>.damaged (orbax ignores it)
STATE_SUMS = "state_sha256"  # JSON item field: {key path: {"dtype", "shape", "sha256"}} of the state's leaves
JSON_SUM = "json_sha256"  # JSON item field: SHA-256 of the rest of the JSON item (STATE_SUMS included)


class CorruptCheckpointError(ValueError):
  """A checkpoint that cannot be restored as it was saved; `step` and `path` (its directory) say which."""
  def __init__(self, message: str, step: int, path: str):
    super().__init__(message)
    self.step, self.path = step, path


def _warn(message: str) -> None:
  print(f"warning: {message}", file=sys.stderr, flush=True)


def _reason(error: BaseException) -> str:
  """One line on why a read failed: the innermost cause's first line (orbax wraps TensorStore's error in
  a message that dumps the whole array spec)."""
  while error.__cause__ or error.__context__:
    error = error.__cause__ or error.__context__
  lines = str(error).strip().splitlines()
  text = f"{type(error).__name__}: {lines[0] if lines else ''}"
  return text if len(text) <= 300 else text[:297] + "..."


def _leaf_records(state: Any) -> dict[str, dict]:
  """{key path: {"dtype", "shape", "sha256" of the bytes}} of every leaf of `state`, fetched to the host
  (sharded arrays whole: the sums do not depend on the layout)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(meshes.to_host(state))
  records = {}
  for path, leaf in leaves:
    array = np.asarray(leaf)
    digest = hashlib.sha256(array.tobytes()).hexdigest()  # of the bytes in C order
    records[jax.tree_util.keystr(path)] = {"dtype": str(array.dtype), "shape": list(array.shape), "sha256": digest}
  return records


def _layout(state: Any) -> dict[str, tuple[str, list]]:
  """{key path: (dtype, shape)} of `state`'s leaves, without fetching them."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(state)
  return {jax.tree_util.keystr(path): (str(leaf.dtype), list(leaf.shape)) for path, leaf in leaves}


def _json_sha256(metadata: dict) -> str:
  return hashlib.sha256(json.dumps(metadata, sort_keys=True).encode()).hexdigest()


def _file_records(directory: str) -> dict[str, list]:
  """{path relative to `directory`: [size, sha256]} of every file below it but the file manifest."""
  records = {}
  for root, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(root, name)
      relative = os.path.relpath(path, directory)
      if not relative.startswith(FILES):  # the manifest, and its temporary file while it is written
        with open(path, "rb") as f:
          records[relative] = [os.path.getsize(path), hashlib.file_digest(f, "sha256").hexdigest()]
  return records


def _listed(names: list[str], limit: int = 3) -> str:
  return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


class Checkpointer:
  """Saves and restores (state, metadata) pairs in `directory`, verifying them on restore."""
  def __init__(self, directory: str, keep: int, keep_every: int = 0, read_only: bool = False):
    """`read_only` opens the checkpoints of another, possibly running, process: nothing is written,
    created, renamed or cleaned up (a writer removes unfinished saves on start)."""
    if keep < 1:
      raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
    policies = [ocp_policy.LatestN(keep)]
    if keep_every:
      policies.append(ocp_policy.EveryNSteps(keep_every))
    self.directory = os.path.abspath(directory)
    self.read_only = read_only
    self.restored = None  # (step, verified) of the checkpoint `restore_newest` returned; None: none
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(preservation_policy=ocp_policy.AnyPreservationPolicy(policies),
                                             cleanup_tmp_directories=not read_only, read_only=read_only,
                                             create=not read_only))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def step_path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state: Any, metadata: dict) -> None:
    """Starts saving (asynchronously: the arrays are copied first, so the caller may donate them).

    The checksums are computed first, on a host copy of `state`: one blocking device-to-host transfer
    of the train state per checkpoint, small next to the train steps between checkpoints."""
    summed = {**metadata, STATE_SUMS: _leaf_records(state)}
    meta = {**summed, JSON_SUM: _json_sha256(summed)}
    self.wait()  # the previous save (long finished, normally): its files get their manifest first
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                      force=True)

  def restore(self, step: int, template: Any) -> tuple[Any, dict, bool]:
    """(state shaped like `template`, metadata, verified) of checkpoint `step`; `verified` is False for a
    checkpoint saved without checksums (restored with a warning).

    Raises `CorruptCheckpointError` when orbax cannot read the step or its content does not match its
    checksums, and a plain ValueError when it holds another layout of state than `template` (a changed
    config, not damage; told apart by the recorded layout, so an unverified checkpoint of another config
    reads as damaged)."""
    path = self.step_path(step)
    damaged = lambda reason: CorruptCheckpointError(f"checkpoint step {step} in {path} is damaged: {reason}", step, path
                                                   )
    bad_file = self._check_files(path)
    if bad_file:
      raise damaged(bad_file)
    try:
      metadata = dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
    except Exception as e:  # orbax raises bare Exceptions, ValueErrors, OSErrors, JSON errors...
      raise damaged(f"its metadata cannot be read ({_reason(e)})") from e
    verified = JSON_SUM in metadata or STATE_SUMS in metadata  # neither: saved before checksums existed
    if verified:
      if metadata.pop(JSON_SUM, None) != _json_sha256(metadata):
        raise damaged("its metadata does not match its checksum")
      sums = metadata.pop(STATE_SUMS)
      saved = {name: (r["dtype"], r["shape"]) for name, r in sums.items()}
      wanted = _layout(template)
      if saved != wanted:
        differ = sorted(set(saved) ^ set(wanted)) or [name for name in saved if saved[name] != wanted[name]]
        raise ValueError(f"checkpoint step {step} in {path} holds another train state than this config "
                         f"builds (differing: {_listed(differ)}): resume with the config that wrote it, or "
                         "use a new workdir")
    try:
      state = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template))).state
    except Exception as e:
      raise damaged(f"its state cannot be read ({_reason(e)})") from e
    if not verified:
      _warn(f"checkpoint step {step} in {path} has no checksums (saved by an older version): restored "
            "unverified")
      return state, metadata, False
    restored = _leaf_records(state)
    bad = [name for name, record in sums.items() if restored[name]["sha256"] != record["sha256"]]
    if bad:
      raise damaged(f"checksum mismatch in {_listed(bad)}")
    return state, metadata, True

  def restore_newest(self, template: Any, fallback: bool = True) -> tuple[int, Any, dict] | None:
    """(step, state, metadata) of the newest checkpoint that restores and verifies; None when there is
    no checkpoint at all. Sets `restored`.

    A damaged checkpoint is reported with a warning naming its step and path, and the next older one is
    tried. Once a good one restores, the newer damaged ones are renamed `<step>.damaged` (kept for
    inspection; orbax then ignores them, so the run's later saves of those steps proceed normally); a
    read-only checkpointer only skips them. With `fallback=False` the first damaged checkpoint raises its
    `CorruptCheckpointError` instead. When checkpoints exist but all are damaged this raises rather than
    restarting from step 0, which would silently discard the run (and they are left in place)."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    damaged = []  # CorruptCheckpointErrors of the steps newer than the one being tried
    for i, step in enumerate(steps):
      try:
        state, metadata, verified = self.restore(step, template)
      except CorruptCheckpointError as e:
        if not fallback:
          raise CorruptCheckpointError(
              f"{e}; not falling back to an older checkpoint "
              "(on_damaged_checkpoint is 'refuse')", e.step, e.path) from e
        _warn(f"{e}; " + (f"trying step {steps[i + 1]}" if i + 1 < len(steps) else "no older checkpoint"))
        damaged.append(e)
        continue
      if damaged and not self.read_only and meshes.is_main_process():
        self._set_aside([e.path for e in damaged])
      self.restored = (step, verified)
      return step, state, metadata
    if damaged:
      raise CorruptCheckpointError(
          f"every checkpoint in {self.directory} is damaged (steps {', '.join(str(e.step) for e in damaged)}; "
          "see the warnings above): not restarting from step 0 over them; move the directory away to start "
          "over", damaged[0].step, self.directory)
    return None

  def _set_aside(self, paths: list[str]) -> None:
    """Renames each damaged checkpoint directory to `<step>.damaged` (`<step>.damaged<n>` when a previous
    one is in the way) and makes orbax forget those steps."""
    for path in paths:
      target, n = path + DAMAGED_SUFFIX, 1
      while os.path.exists(target):
        n += 1
        target = f"{path}{DAMAGED_SUFFIX}{n}"
      os.rename(path, target)
      _warn(f"set the damaged checkpoint aside as {target}; the run saves that step again when it gets there")
    self.manager.reload()

  def _check_files(self, path: str) -> str | None:
    """Why the files of the step directory `path` differ from its manifest; None when they match or
    it has none (a save that had not finished when the run stopped, or an older version's)."""
    manifest = os.path.join(path, FILES)
    if not os.path.exists(manifest):
      return None
    try:
      with open(manifest) as f:
        recorded = json.load(f)
    except (OSError, ValueError) as e:
      return f"its file manifest {FILES} cannot be read ({e})"
    found = _file_records(path)
    for relative, (size, digest) in sorted(recorded.items()):
      if relative not in found:
        return f"file {relative} is missing"
      if found[relative][0] != size:
        return f"file {relative} has {found[relative][0]} bytes, {size} were saved"
      if found[relative][1] != digest:
        return f"file {relative} does not match its checksum"
    return None

  def _seal_finished(self) -> None:
    """Writes the file manifest of every finished step that lacks one (atomically)."""
    for step in self.manager.all_steps():
      path = self.step_path(step)
      manifest = os.path.join(path, FILES)
      if os.path.isdir(path) and not os.path.exists(manifest):
        records = _file_records(path)
        with open(manifest + ".tmp", "w") as f:
          json.dump(records, f, indent=0, sort_keys=True)
        os.replace(manifest + ".tmp", manifest)

  def wait(self) -> None:
    """Blocks until every started save is on disk, then records its files' checksums."""
    self.manager.wait_until_finished()
    if not self.read_only and meshes.is_main_process():
      self._seal_finished()

  def close(self) -> None:
    self.wait()
    self.manager.close()
