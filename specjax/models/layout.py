"""The two layouts of a model's per-layer parameters, and the conversions between them.

Per-layer (`scan_layers=False`, what every loader produces and every exporter writes): one subtree
`layers_{i}` per block. Stacked (`scan_layers=True`): one subtree `layers` whose leaves have a leading
[L] axis, run by `lax.scan` so that the program holds one copy of the block, whatever the depth.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig

Params = Any


def stack_layers(params: Params, n_layers: int) -> Params:
  """Per-layer subtrees `layers_{i}` -> one `layers` subtree whose leaves gain a leading [L] axis (the
  `scan_layers` layout). Peak memory: the per-layer arrays plus their stacked copy."""
  params = dict(params)
  per_layer = [params.pop(f"layers_{i}") for i in range(n_layers)]
  params["layers"] = jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_layer)
  return params


def unstack_layers(params: Params) -> Params:
  """The inverse of `stack_layers`: a stacked `layers` subtree back to `layers_{i}` subtrees."""
  params = dict(params)
  stacked = params.pop("layers")
  n_layers = jax.tree.leaves(stacked)[0].shape[0]
  for i in range(n_layers):
    params[f"layers_{i}"] = jax.tree.map(lambda leaf: leaf[i], stacked)
  return params


def to_layout(config: ModelConfig, params: Params) -> Params:
  """`params` (either layout) in the layout `config.scan_layers` asks for."""
  stacked = "layers" in params
  if config.scan_layers and not stacked:
    return stack_layers(params, config.n_layers)
  if not config.scan_layers and stacked:
    return unstack_layers(params)
  return params
