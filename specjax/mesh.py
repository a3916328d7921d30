"""The device mesh of a run: parsed from a config string, and the multi-process start that precedes it.

`mesh = "data=2,model=4"` names the size of each axis of a `jax.sharding.Mesh`: `data` splits the
batch (rows, and in distillation the optimizer's parameter shards, FSDP-style), `model` splits the
weights' heads, MLP hidden units and vocabulary rows (tensor parallelism). An empty string is one
device (no mesh: every program runs as before); one axis may be `-1`, "all remaining devices". The
product must equal the number of devices (of all processes together).

Axes are GSPMD's automatic kind: the programs are written for one device and XLA partitions them from
the shardings of their inputs and a few constraints (`specjax.partitioning`); nothing here
communicates by hand.

Multi-process: `initialize_distributed` calls `jax.distributed.initialize()` when the environment
describes a multi-process job (an explicit coordinator, a SLURM job step with several tasks, or a TPU
pod slice) and must run before anything touches a device. Then every process runs the same program
on the global mesh; only process 0 writes results and logs (`is_main_process`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "model")  # every mesh has both, in this order (size 1 when not named)


def parse_mesh(spec: str) -> dict[str, int]:
  """{"data": n, "model": m} from "data=2,model=4" ("" = {}; -1 = to be filled); ValueError naming
  the bad part otherwise."""
  sizes: dict[str, int] = {}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    name, equals, value = part.partition("=")
    name = name.strip()
    if not equals or name not in AXES:
      raise ValueError(f"mesh {spec!r}: {part!r} is not AXIS=SIZE with AXIS one of {AXES}")
    if name in sizes:
      raise ValueError(f"mesh {spec!r}: axis {name!r} is given twice")
    try:
      size = int(value)
    except ValueError:
      raise ValueError(f"mesh {spec!r}: size {value.strip()!r} of axis {name!r} is not an integer") from None
    if size < 1 and size != -1:
      raise ValueError(f"mesh {spec!r}: axis {name!r} has size {size}; sizes are >= 1, or -1 for the rest")
    sizes[name] = size
  if list(sizes.values()).count(-1) > 1:
    raise ValueError(f"mesh {spec!r}: only one axis may be -1")
  return sizes


def axis_sizes(spec: str, num_devices: int) -> tuple[int, ...]:
  """The (data, model) sizes of `spec` for `num_devices` devices, -1 resolved; the product must be
  the device count."""
  sizes = parse_mesh(spec)
  known = math.prod(s for s in sizes.values() if s != -1)
  if -1 in sizes.values():
    if num_devices % known:
      raise ValueError(f"mesh {spec!r}: {num_devices} devices do not split over the fixed axes ({known})")
    sizes = {name: num_devices // known if s == -1 else s for name, s in sizes.items()}
  shape = tuple(sizes.get(name, 1) for name in AXES)
  if math.prod(shape) != num_devices:
    raise ValueError(f"mesh {spec!r} has {math.prod(shape)} devices ({' x '.join(map(str, shape))}), "
                     f"but {num_devices} are present")
  return shape


def make_mesh(spec: str, devices: Sequence[jax.Device] | None = None) -> Mesh | None:
  """The `Mesh` of `spec` over `devices` (default: every device of every process); None for ""."""
  if not spec.strip():
    return None
  devices = list(jax.devices() if devices is None else devices)
  shape = axis_sizes(spec, len(devices))
  if devices == list(jax.devices()):  # the topology-aware order (ICI rings on TPU, NVLink islands)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))
  return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def describe(mesh: Mesh | None) -> dict:
  """What a results file records about the devices: mesh shape, device kind and count, processes."""
  devices = jax.devices()
  return {
      "mesh": dict(mesh.shape) if mesh is not None else {}, "device_kind": devices[0].device_kind,
      "device_count": len(devices), "process_count": jax.process_count()
  }


def _multi_process_environment() -> str:
  """Which multi-process launch the environment describes ("" when none)."""
  env = os.environ
  if env.get("JAX_COORDINATOR_ADDRESS") or env.get("COORDINATOR_ADDRESS"):
    return "coordinator"
  if int(env.get("SLURM_NTASKS", env.get("SLURM_STEP_NUM_TASKS", "1")) or 1) > 1:
    return "slurm"
  if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
    return "tpu"
  return ""


def initialize_distributed() -> bool:
  """Starts the multi-process runtime when the environment asks for it; True if it did.

  An explicit coordinator reads JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (one
  process per host, each seeing its local GPUs); SLURM and TPU pod slices are detected by
  `jax.distributed.initialize()` itself. Idempotent: a second call does nothing."""
  kind = _multi_process_environment()
  if not kind or jax.distributed.is_initialized():
    return False
  if kind == "coordinator":
    env = os.environ
    missing = [v for v in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if v not in env]
    if missing:
      raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {', '.join(missing)} is not: a multi-process "
                       "run needs all three")
    jax.distributed.initialize(
        env.get("JAX_COORDINATOR_ADDRESS") or env["COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]),
        int(env["JAX_PROCESS_ID"]))
  else:
    jax.distributed.initialize()
  return True


def to_host(tree: Any) -> Any:
  """Numpy copies of the (global) arrays in `tree`: `jax.device_get` in one process; in several, each
  array's shards are first gathered from every process."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def is_main_process() -> bool:
  """Process 0 writes results, logs and checkpoint metadata; the others compute only."""
  return jax.process_index() == 0
