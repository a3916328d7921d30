"""The adaptive K policy's measured cost tables, kept on disk per machine and compiled program, so that a
program's calibration (a minute or two for a 1.5B target on a CPU) is paid once per machine, not once per
run.

A table is stored under `$SPECJAX_COST_TABLES` (default `$SPECJAX_CACHE/cost_tables`) in a JSON file named
by the hash of its description: the machine (host name, processor, device kind and count, jax version)
and every setting that shapes the program's rounds (`pipeline` describes them: the config fields that
are compiled in, the cache length, sampling's static flags, the drafter's class). A table only steers
which proposal lengths the policy chooses, never what it outputs; a stale one (the machine got busier)
costs speed, and `adaptive.reuse_costs = False` measures again and replaces it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
from typing import Any

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


def load(description: dict[str, Any], lengths: tuple[int, ...]) -> tuple[np.ndarray, str] | tuple[None, str]:
  """(the cost table [C] stored for `description`, when it was measured), or (None, why not: "" when none
  is stored). A file that does not hold a table of these lengths (damaged, another layout) is not used."""
  path = _path(description)
  if not os.path.isfile(path):
    return None, ""
  try:
    with open(path) as f:
      stored = json.load(f)
    cost_C = np.asarray(stored["cost_table_s"], np.float32)
    if (stored["description"] != json.loads(json.dumps(description, default=repr))
            or stored["lengths"] != list(lengths) or cost_C.shape != (len(lengths),)
            or not np.all(np.isfinite(cost_C) & (cost_C > 0))):
      raise ValueError("it describes another program or holds no valid table")
    return cost_C, str(stored["measured_at"])
  except (OSError, ValueError, KeyError, TypeError) as e:
    return None, f"ignoring the stored cost table {path} ({e})"


def save(description: dict[str, Any], lengths: tuple[int, ...], cost_C: np.ndarray, seconds: float) -> str:
  """Stores a measured table for `description` (replacing any); returns its file."""
  path = _path(description)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  record = {"description": description, "lengths": list(lengths), "cost_table_s": [float(c) for c in cost_C],
            "calibration_time_s": seconds,
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1, default=repr)
  os.replace(tmp, path)
  return path
