"""The adaptive K policy's measured cost tables, kept on disk per machine and compiled program, so that a
program's calibration (a minute or two for a 1.5B target on a CPU) is paid once per machine, not once per
run.

A table is stored under `$SPECJAX_COST_TABLES` (default `$SPECJAX_CACHE/cost_tables`) in a JSON file named
by the hash of its description: the machine (host name, processor, device kind and count, jax version)
and every setting that shapes the program's rounds (`pipeline` describes them: the config fields that
are compiled in, the cache length, sampling's static flags, the drafter's class). A table only steers
which proposal lengths the policy chooses, never what it outputs; a stale one (the machine got busier)
costs speed, and `adaptive.reuse_costs = False` measures again and replaces it.

Beside the table: the acceptance calibration observed (its forced rounds: those that reached and
accepted each draft position), which a later run learns as its prior (`k_policy.Memory.learn`), as the
run that measured it did. Without it a run with a stored table starts from the configured prior, and a
policy that then chooses plain rounds never observes the pair's acceptance.
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
  return {"host": platform.node(), "processor": platform.processor() or platform.machine(),
          "cpus": os.cpu_count(), "platform": devices[0].platform, "device_kind": devices[0].device_kind,
          "devices": len(devices), "processes": jax.process_count(), "jax": jax.__version__}


def _path(description: dict[str, Any]) -> str:
  digest = hashlib.sha256(json.dumps(description, sort_keys=True, default=repr).encode()).hexdigest()
  return os.path.join(directory(), f"{digest[:32]}.json")


class Stored(NamedTuple):
  cost_C: np.ndarray  # [C] seconds per round at each candidate length
  measured_at: str  # ISO time
  reached_K: np.ndarray  # [K] calibration's rounds (summed over rows) that reached each draft position
  accepted_K: np.ndarray  # [K] those that accepted it (zeros, with reached_K, in a file that has none)


def load(description: dict[str, Any], lengths: tuple[int, ...], k: int) -> tuple[Stored | None, str]:
  """(what is stored for `description`, ""), or (None, why not: "" when nothing is stored). A file that
  does not hold a table of these lengths and counts of K positions (damaged, another layout) is not used."""
  path = _path(description)
  if not os.path.isfile(path):
    return None, ""
  try:
    with open(path) as f:
      stored = json.load(f)
    cost_C = np.asarray(stored["cost_table_s"], np.float32)
    reached_K = np.asarray(stored.get("calibration_reached", [0.0] * k), np.float64)
    accepted_K = np.asarray(stored.get("calibration_accepted", [0.0] * k), np.float64)
    if (stored["description"] != json.loads(json.dumps(description, default=repr))
            or stored["lengths"] != list(lengths) or cost_C.shape != (len(lengths),)
            or not np.all(np.isfinite(cost_C) & (cost_C > 0))
            or reached_K.shape != (k,) or accepted_K.shape != (k,)
            or not np.all((0 <= accepted_K) & (accepted_K <= reached_K))):
      raise ValueError("it describes another program or holds no valid table")
    return Stored(cost_C, str(stored["measured_at"]), reached_K, accepted_K), ""
  except (OSError, ValueError, KeyError, TypeError) as e:
    return None, f"ignoring the stored cost table {path} ({e})"


def save(description: dict[str, Any], lengths: tuple[int, ...], cost_C: np.ndarray, seconds: float,
         reached_K: np.ndarray, accepted_K: np.ndarray) -> str:
  """Stores a measured table for `description`, with the acceptance its calibration observed (replacing
  any); returns its file."""
  path = _path(description)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  record = {"description": description, "lengths": list(lengths), "cost_table_s": [float(c) for c in cost_C],
            "calibration_time_s": seconds, "calibration_reached": [float(n) for n in reached_K],
            "calibration_accepted": [float(n) for n in accepted_K],
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1, default=repr)
  os.replace(tmp, path)
  return path
