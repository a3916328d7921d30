"""Assembling a checkpoint's tensors into specjax's parameter tree, with errors that name the problem.

Every loader maps its own tensor names to slash-separated specjax paths (`layers_3/attn/q_proj/weight`)
and hands the arrays to `assemble_params`, which checks them against the shapes that `ModelConfig`
implies: a missing tensor, an unexpected extra one, or a shape mismatch fails before any compute.
It then places them one at a time (`place`, e.g. each device receiving its own shard of a mesh, by a
placement the caller passes in): with lazy arrays the host holds one tensor at a time.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.transformer import Params, init_params


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Slash-separated parameter path -> shape, for every parameter the config implies."""
  abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
  return {"/".join(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


class LazyTensor:
  """A checkpoint tensor read (dequantized, transformed) only when converted to an array."""
  def __init__(self, shape: tuple[int, ...], make: Callable[[], np.ndarray]):
    self.shape = shape
    self._make = make

  def __array__(self, dtype=None, copy=None):
    array = self._make()
    return array if dtype is None else array.astype(dtype, copy=False)


# (config) -> (parameter path, host array) -> the placed array: `on_one_device`, or the caller's mesh.
Placement = Callable[[ModelConfig], Callable[[str, Any], Any]]


def on_one_device(config: ModelConfig) -> Callable[[str, Any], jax.Array]:
  """The placement without a mesh: each parameter one array in `config.dtype` on the default device
  (an aligned float32 host buffer becomes the device array without a copy, on CPU)."""
  dtype = config.jnp_dtype
  return lambda path, array: jax.device_put(np.asarray(array, dtype))


def assemble_params(config: ModelConfig, arrays: Mapping[str, np.ndarray], source: str,
                    placement: Placement | None = None) -> Params:
  """Nested params from path -> array (numpy, or lazy: read when placed), each made by
  `placement(config)` (default: an array in `config.dtype` on the default device); `source` names the
  checkpoint in errors. Every name and shape is checked before the first tensor is read."""
  expected = expected_shapes(config)
  missing = sorted(set(expected) - set(arrays))
  extra = sorted(set(arrays) - set(expected))
  if missing:
    raise ValueError(f"{source}: missing tensor(s) for {missing[:8]}{' ...' if len(missing) > 8 else ''}")
  if extra:
    raise ValueError(f"{source}: unexpected extra tensor(s) {extra[:8]}{' ...' if len(extra) > 8 else ''}")
  for path, shape in expected.items():
    if tuple(arrays[path].shape) != shape:
      raise ValueError(f"{source}: shape mismatch for {path}: checkpoint has {tuple(arrays[path].shape)}, "
                       f"the config implies {shape}")
  place = placement(config) if placement else (
      lambda path, array: jax.numpy.asarray(np.asarray(array), dtype=config.jnp_dtype))
  params: dict = {}
  for path in expected:
    node = params
    *parents, leaf = path.split("/")
    for name in parents:
      node = node.setdefault(name, {})
    node[leaf] = place(path, arrays[path])
  return params
