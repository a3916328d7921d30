"""Assembling a checkpoint's tensors into specjax's parameter tree, with errors that name the problem.

Every loader maps its own tensor names to slash-separated specjax paths (`layers_3/attn/q_proj/weight`)
and hands the arrays to `assemble_params`, which checks them against the shapes that `ModelConfig`
implies: a missing tensor, an unexpected extra one, or a shape mismatch fails before any compute.
"""

from __future__ import annotations

from typing import Mapping

import jax
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.transformer import Params, init_params


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Slash-separated parameter path -> shape, for every parameter the config implies."""
  abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
  return {"/".join(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def assemble_params(config: ModelConfig, arrays: Mapping[str, np.ndarray], source: str) -> Params:
  """Nested params (in `config.dtype`) from path -> array; `source` names the checkpoint in errors."""
  expected = expected_shapes(config)
  missing = sorted(set(expected) - set(arrays))
  extra = sorted(set(arrays) - set(expected))
  if missing:
    raise ValueError(f"{source}: missing tensor(s) for {missing[:8]}{' ...' if len(missing) > 8 else ''}")
  if extra:
    raise ValueError(f"{source}: unexpected extra tensor(s) {extra[:8]}{' ...' if len(extra) > 8 else ''}")
  params: dict = {}
  for path, shape in expected.items():
    array = arrays[path]
    if tuple(array.shape) != shape:
      raise ValueError(f"{source}: shape mismatch for {path}: checkpoint has {tuple(array.shape)}, "
                       f"the config implies {shape}")
    node = params
    *parents, leaf = path.split("/")
    for name in parents:
      node = node.setdefault(name, {})
    node[leaf] = jax.numpy.asarray(array, dtype=config.jnp_dtype)
  return params

