"""Where every array lives on the mesh: partition rules as data, and the shardings they imply.

Two tables, in the style of MaxText's `logical_axis_rules`:
  PARAM_AXES  parameter name -> the logical axis of each dimension ("vocab", "heads", "embed", ...)
  *_RULES     logical axis -> mesh axis ("data", "model") or None (replicated)
`DECODE_RULES` is tensor parallelism over `model` (attention heads, MLP hidden units and vocabulary
rows split; norms and the residual width whole); `FSDP_RULES` adds the residual width on `data`, so
that training also splits every weight and its optimizer moments over the batch axis (ZeRO-3 / FSDP:
XLA gathers a weight's shards where it is used and reduce-scatters its gradient).

Divisibility is checked on the units an axis splits, not on array sizes: query heads (a shard holds
whole heads), key/value heads, MLP hidden units, vocabulary rows, batch rows. A dimension whose units
do not divide the mesh axis is an error naming the model, the axis and the sizes that would work;
with `indivisible="replicate"` it is kept whole on every device instead (more memory, same numbers).
Key/value heads fewer than the model axis (grouped-query attention: Qwen2.5-1.5B has 2 for 12 query
heads) are always replicated: each device computes the few k/v heads itself, keeps the whole cache's
head axis, and reads the ones its query heads use; the cache then costs `model` times more memory
than a split one, while splitting head_dim instead would add an all-reduce of the attention scores to
every layer of every step. When query heads are replicated, so are the key/value heads.

Caches [L, B, S, G, Dh]: B on `data`, G on `model` (when split). Prompts, outputs and per-row
state: rows on `data`. Inside the jitted programs `constrain` pins a few intermediate shardings that
GSPMD would otherwise choose badly; it does nothing when no mesh is set (`jax.set_mesh`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.models.config import ModelConfig
from specjax.models.param_tree import on_one_device

# Parameter path (per-layer layout, `layers_{i}/` removed) -> logical axes of its dimensions.
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(embed/embedding|lm_head/weight)", ("vocab", "embed")),
    (r"pos_embed/embedding", (None, "embed")),
    (r"attn/q_proj/weight", ("heads", "embed")),
    (r"attn/q_proj/bias", ("heads",)),
    (r"attn/[kv]_proj/weight", ("kv_heads", "embed")),
    (r"attn/[kv]_proj/bias", ("kv_heads",)),
    (r"attn/o_proj/weight", ("embed", "heads")),
    (r"mlp/(gate|up)_proj/weight", ("mlp", "embed")),
    (r"mlp/(gate|up)_proj/bias", ("mlp",)),
    (r"mlp/down_proj/weight", ("embed", "mlp")),
    (r"(attn/o_proj|mlp/down_proj)/bias", ("embed",)),
    (r"(.*/)?\w*norm/(scale|bias)", (None,)),  # every norm, incl. per-head q/k norms: whole
)

DECODE_RULES: tuple[tuple[str, str | None], ...] = (("batch", "data"), ("vocab", "model"), ("heads", "model"),
                                                    ("kv_heads", "model"), ("mlp", "model"), ("embed", None))
FSDP_RULES: tuple[tuple[str, str | None], ...] = tuple(
    (logical, "data" if logical == "embed" else mesh_axis) for logical, mesh_axis in DECODE_RULES)
INDIVISIBLE = ("error", "replicate")

_UNIT_NAMES = {
    "vocab": "vocabulary rows", "heads": "query heads", "kv_heads": "key/value heads", "mlp": "MLP hidden units",
    "embed": "residual-width units"
}


def _units(config: ModelConfig) -> dict[str, int]:
  """How many whole units each logical parameter axis splits into."""
  return {
      "vocab": config.vocab_size, "heads": config.n_heads, "kv_heads": config.n_kv_heads, "mlp": config.d_ff,
      "embed": config.d_model
  }


@dataclasses.dataclass(frozen=True)
class Partitioning:
  """How one model is laid out on a mesh: the rules, and what to do with indivisible axes.

  `name` ("target", "draft", "student") makes errors say which model does not split."""

  mesh: Mesh
  rules: tuple[tuple[str, str | None], ...] = DECODE_RULES
  indivisible: str = "error"
  name: str = "model"

  def __post_init__(self):
    if self.indivisible not in INDIVISIBLE:
      raise ValueError(f"indivisible must be one of {INDIVISIBLE}, got {self.indivisible!r}")

  def axis_size(self, mesh_axis: str | None) -> int:
    return 1 if mesh_axis is None else self.mesh.shape[mesh_axis]

  def replicated(self) -> "Partitioning":
    """The same mesh with every weight whole on every device (rows still split over `data`)."""
    return dataclasses.replace(self, rules=tuple((l, a if l == "batch" else None) for l, a in self.rules))

  def resolve(self, config: ModelConfig) -> dict[str, str | None]:
    """Logical axis -> mesh axis for `config`, after the divisibility checks (see the module doc)."""
    rules, units = dict(self.rules), _units(config)
    for logical in ("heads", "mlp", "vocab", "embed"):
      size = self.axis_size(rules.get(logical))
      if units[logical] % size == 0:
        continue
      if self.indivisible == "error":
        fits = [d for d in range(1, self.mesh.size + 1) if units[logical] % d == 0]
        raise ValueError(f"{self.name}: its {units[logical]} {_UNIT_NAMES[logical]} do not split over mesh "
                         f"axis {rules[logical]!r} of size {size} (axis sizes up to {self.mesh.size} that "
                         f"divide them: {fits}); choose "
                         f"another mesh, or keep them whole on every device (config.mesh_indivisible="
                         f"'replicate'; for a draft model also config.draft_sharding='replicated')")
      rules[logical] = None
    if rules.get("heads") is None or units["kv_heads"] % self.axis_size(rules.get("kv_heads")):
      rules["kv_heads"] = None
    return rules

  def sharding(self, *mesh_axes: str | None) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec(*mesh_axes))

  # What the loaders of `specjax.models.load` ask of the partitioning they are handed.
  def placement(self, config: ModelConfig) -> Callable[[str, Any], jax.Array]:
    return placer(config, self)

  def shard(self, config: ModelConfig, params: Any) -> Any:
    return shard_params(config, params, self)


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
  """The logical axes of parameter `path` (either layout; a stacked `layers/` leaf gains a leading
  None for its [L] axis); ValueError for a name the table does not know."""
  stacked = path.startswith("layers/")
  name = re.sub(r"^layers(_\d+)?/", "", path)
  for pattern, axes in PARAM_AXES:
    if re.fullmatch(pattern, name):
      axes = (None,) * stacked + axes
      if len(axes) != ndim:
        raise ValueError(f"parameter {path} has {ndim} dimensions, the partition rules expect {len(axes)}")
      return axes
  raise ValueError(f"no partition rule for parameter {path!r}; add its logical axes to PARAM_AXES")


def _path_string(path) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in path)


def param_spec(config: ModelConfig, part: Partitioning, path: str, ndim: int) -> PartitionSpec:
  rules = part.resolve(config)
  return PartitionSpec(*(rules.get(axis) if axis else None for axis in logical_axes(path, ndim)))


def param_shardings(config: ModelConfig, params: Any, part: Partitioning) -> Any:
  """A tree of `NamedSharding`s matching `params` (arrays or shape structs, either layout)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: NamedSharding(part.mesh, param_spec(config, part, _path_string(path), leaf.ndim)), params)


def shard_params(config: ModelConfig, params: Any, part: Partitioning | None) -> Any:
  """`params` laid out by `part` (a no-op for leaves already there; None: unchanged)."""
  if part is None:
    return params
  return jax.device_put(params, param_shardings(config, params, part))


def placer(config: ModelConfig, part: Partitioning | None) -> Callable[[str, Any], jax.Array]:
  """`place(path, host_array)`: the parameter as a device array in `config.dtype`, each device
  receiving only its own shard, cut from the host array (which may be lazy: read when asked).
  Without a partitioning: one array on the default device."""
  if part is None:
    return on_one_device(config)
  dtype = config.jnp_dtype

  def place(path: str, array: Any) -> jax.Array:
    array = np.asarray(array)  # a lazy array reads (dequantizes) its tensor once, here
    sharding = part.sharding(*param_spec(config, part, path, array.ndim))
    return jax.make_array_from_callback(array.shape, sharding, lambda index: np.asarray(array[index], dtype))

  return place


@dataclasses.dataclass(frozen=True)
class CacheSharding:
  """A cache [L, B, S, G, Dh] on the ambient mesh (`init_cache(..., sharding)`): `axes` names the mesh
  axis of each dimension; `kv` pins keys/values there, `rows` the per-row lengths."""

  axes: tuple[str | None, ...]

  def kv(self, x_LxBxSxGxDh: jax.Array) -> jax.Array:
    return constrain(x_LxBxSxGxDh, *self.axes)

  def rows(self, x_B: jax.Array) -> jax.Array:
    return constrain(x_B, self.axes[1])


def cache_sharding(config: ModelConfig, part: Partitioning | None) -> CacheSharding | None:
  """Where a cache of `config` lies: rows on `data`, key/value heads on `model` when the model splits
  them (see the module doc); None without a mesh."""
  if part is None:
    return None
  return CacheSharding((None, dict(part.rules).get("batch"), None, part.resolve(config).get("kv_heads"), None))


def rows_sharding(part: Partitioning) -> NamedSharding:
  """Per-row arrays [B, ...] (prompts, lengths, budgets, token buffers): rows on `data`."""
  return part.sharding(dict(part.rules).get("batch"))


def constrain(x: jax.Array, *mesh_axes: str | None) -> jax.Array:
  """`x` pinned to PartitionSpec(*mesh_axes) under the ambient mesh (`jax.set_mesh`); unchanged
  without one, or when an axis does not divide its dimension."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  for size, axis in zip(x.shape, mesh_axes):
    if axis is not None and size % mesh.shape[axis]:
      return x
  return jax.lax.with_sharding_constraint(x, PartitionSpec(*mesh_axes))


def bytes_per_device(tree: Any) -> dict[str, int]:
  """Bytes each device holds of the arrays in `tree` (device id -> bytes; addressable shards)."""
  total: dict[str, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      key = str(shard.device.id)
      total[key] = total.get(key, 0) + shard.data.nbytes
  return total
