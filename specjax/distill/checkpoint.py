"""Checkpoints that never lose work: an orbax `CheckpointManager` over the train state and its metadata.

One checkpoint per saved step, under `WORKDIR/checkpoints/<step>`: the train state pytree (params,
optimizer state, step, RNG key) via `StandardSave`, and a JSON item (data-stream position and fingerprint,
anything else the loop must resume exactly) via `JsonSave`. Orbax writes each step to a temporary
directory and renames it when complete, so a run killed mid-save leaves the previous checkpoint as the
latest; rerunning the same command restores it. The preservation policy keeps the newest `keep`
checkpoints plus, optionally, every `keep_every`-th step.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as ocp_policy


class Checkpointer:
  """Saves and restores (state, metadata) pairs in `directory`."""

  def __init__(self, directory: str, keep: int, keep_every: int = 0, read_only: bool = False):
    """`read_only` opens the checkpoints of another, possibly running, process: nothing is written,
    created or cleaned up (a writer removes unfinished saves on start)."""
    if keep < 1:
      raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
    policies = [ocp_policy.LatestN(keep)]
    if keep_every:
      policies.append(ocp_policy.EveryNSteps(keep_every))
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(preservation_policy=ocp_policy.AnyPreservationPolicy(policies),
                                             cleanup_tmp_directories=not read_only, read_only=read_only,
                                             create=not read_only))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, metadata: dict) -> None:
    """Starts saving (asynchronously: the arrays are copied first, so the caller may donate them)."""
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(metadata)), force=True)

  def restore(self, step: int, template: Any) -> tuple[Any, dict]:
    """(state shaped like `template`, metadata) of checkpoint `step`."""
    restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template),
                                                                  meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
