"""The adaptive K policy's measured cost tables, kept on disk per machine and compiled program, so that a
program's calibration (a minute or two for a 1.5B target on a CPU) is paid once per machine, not once per
run.

A table is stored under `$SPECJAX_COST_TABLES` (default `$SPECJAX_CACHE/cost_tables`) in a JSON file named
by the hash of its description: the machine (host name, processor, device kind and count, jax version)
and every setting that shapes the program's rounds (`DecodeSpec.description`: the config fields that
are compiled in, the cache length, sampling's static flags, the drafter's class). A table only steers
which proposal lengths the policy chooses, never what it outputs; a stale one (the machine got busier)
costs speed, and `adaptive.reuse_costs = False` measures again and replaces it.

Beside the table: the acceptance calibration observed (its forced rounds: those that reached and
accepted each draft position, per acceptance estimate of `k_policy`), which a later run learns as its
prior (`k_policy.Memory.learn`), as the run that measured it did. Without it a run with a stored table starts
from the configured prior, and a policy that then chooses plain rounds never observes the pair's acceptance.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
from typing import Any, NamedTuple

import jax
import numpy as np

from specjax.models import registry

DIRECTORY_ENV = "SPECJAX_COST_TABLES"


def directory() -> str:
  return os.environ.get(DIRECTORY_ENV) or os.path.join(registry.cache_dir(), "cost_tables")


def machine() -> dict[str, Any]:
  """What the costs were measured on."""
  devices = jax.devices()
  return {
      "host": platform.node(), "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
      "platform": devices[0].platform, "device_kind": devices[0].device_kind, "devices": len(devices),
      "processes": jax.process_count(), "jax": jax.__version__
  }


def _path(description: dict[str, Any]) -> str:
  digest = hashlib.sha256(json.dumps(description, sort_keys=True, default=repr).encode()).hexdigest()
  return os.path.join(directory(), f"{digest[:32]}.json")


class Stored(NamedTuple):
  cost_C: np.ndarray  # [C] seconds per round at each candidate
  measured_at: str  # ISO time
  reached_AxK: np.ndarray  # [A, K] calibration's rounds (summed over rows) that reached each draft position
  accepted_AxK: np.ndarray  # [A, K] those that accepted it (zeros, with reached_AxK, in a file that has none)
  prefill_s: float = 0.0  # seconds of a call before its rounds (0 in a file that has none)
  catch_up_s: float = 0.0  # a call's first drafting round beyond a steady one (0 in a file that has none)


def _candidates_record(candidates: tuple[Any, ...]) -> dict[str, list]:
  """A table's candidates (`k_policy.Candidate`s) as stored: their lengths and spine flags."""
  return {"lengths": [c.length for c in candidates], "spine": [c.spine for c in candidates]}


def _counts(stored: dict[str, Any], field: str, counts_shape: tuple[int, int]) -> np.ndarray:
  """A stored file's counts of one field: zeros when it has none, one row when it has [K] (as written
  before spines)."""
  counts = np.asarray(stored.get(field, np.zeros(counts_shape)), np.float64)
  return counts[None] if counts.ndim == 1 else counts


def load(description: dict[str, Any], candidates: tuple[Any, ...],
         counts_shape: tuple[int, int]) -> tuple[Stored | None, str]:
  """(what is stored for `description`, ""), or (None, why not: "" when nothing is stored). A file that
  does not hold a table of these candidates and counts of `counts_shape` = (A, K) (damaged, another
  layout) is not used; a file written before spines (no "spine", counts [K]) reads as all whole cuts and
  one row of counts."""
  path = _path(description)
  if not os.path.isfile(path):
    return None, ""
  try:
    with open(path) as f:
      stored = json.load(f)
    cost_C = np.asarray(stored["cost_table_s"], np.float32)
    reached_AxK, accepted_AxK = (
        _counts(stored, field, counts_shape) for field in ("calibration_reached", "calibration_accepted"))
    wanted = _candidates_record(candidates)
    if (stored["description"] != json.loads(json.dumps(description, default=repr)) or
        stored["lengths"] != wanted["lengths"] or
        stored.get("spine", [False] * len(stored["lengths"])) != wanted["spine"] or
        cost_C.shape != (len(candidates),) or not np.all(np.isfinite(cost_C) & (cost_C > 0)) or
        reached_AxK.shape != tuple(counts_shape) or accepted_AxK.shape != tuple(counts_shape) or
        not np.all((0 <= accepted_AxK) & (accepted_AxK <= reached_AxK))):
      raise ValueError("it describes another program or holds no valid table")
    return Stored(cost_C, str(stored["measured_at"]), reached_AxK, accepted_AxK, float(stored.get("prefill_s", 0.0)),
                  float(stored.get("catch_up_s", 0.0))), ""
  except (OSError, ValueError, KeyError, TypeError) as e:
    return None, f"ignoring the stored cost table {path} ({e})"


def save(description: dict[str, Any], candidates: tuple[Any, ...], cost_C: np.ndarray, seconds: float,
         reached_AxK: np.ndarray, accepted_AxK: np.ndarray, prefill_s: float = 0.0, catch_up_s: float = 0.0) -> str:
  """Stores a measured table for `description`, with the acceptance its calibration observed, the
  seconds of a call's prefill and of its first drafting round's catch-up (replacing any); returns its
  file."""
  path = _path(description)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  record = {
      "description": description, **_candidates_record(candidates), "cost_table_s": [float(c) for c in cost_C],
      "calibration_time_s": seconds, "calibration_reached": np.asarray(reached_AxK, float).tolist(),
      "calibration_accepted": np.asarray(accepted_AxK, float).tolist(), "prefill_s": float(prefill_s),
      "catch_up_s": float(catch_up_s),
      "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  }
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1, default=repr)
  os.replace(tmp, path)
  return path
