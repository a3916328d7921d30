"""A decode config, checked and parsed once into a frozen `DecodeSpec`: the library behind
`python -m specjax.decode`, `specjax.Decoder` and the sweeps works from the spec, never from the raw
ConfigDict at depth. Every check names the field and runs before any model loads.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import jax
import ml_collections

from specjax import decode_config, lowering, mesh as meshes, partitioning
from specjax.constraints import compiler
from specjax.errors import ConfigError
from specjax.models import matmul, quantized
from specjax.models.execution import Execution, resolve_dtype
from specjax.sampling import Knobs, SamplingParams, sampling_params
from specjax.speculative.drafters import registry
from specjax.speculative import k_policy
from specjax.speculative.drafters.base import Drafter, DrafterSettings
from specjax.speculative.trees import shapes
from specjax.speculative.trees.dynamic import DynamicSpec
from specjax.speculative.trees.tree import Tree, parse

MODES = ("speculative", "autoregressive")
DTYPES = ("auto", "float32", "bfloat16")
DRAFT_SHARDINGS = ("same", "replicated")
# Fields that change which models are loaded or how (a Decoder loads them once; sweep points reload);
# "model.weights" is the draft model's weight format (a dotted path: ConfigDict reads it as one key).
LOAD_FIELDS = ("target", "draft", "dtype", "mesh", "mesh_indivisible", "draft_sharding", "scan_layers", "attention",
               "attention_block", "narrow_passes", "prefill_chunk", "matmul", "weights", "model.weights")
# Top-level fields that only speculative runs read; every drafter group is speculative-only too.
SPECULATIVE_FIELDS = ("k", "k_policy", "drafter", "draft", "tree", "tree_children")
# Config fields that reach a compiled program only as runtime values (or not at all): a run changing
# only these reuses the program an earlier run compiled (sampling's static flags are keyed apart).
RUNTIME_FIELDS = ("prompts", "prompts_file", "seed", "output", "temperature", "top_k", "top_p", "max_new_tokens",
                  "chat", "profile")


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """A validated decode config with its parsed parts."""

  config: ml_collections.FrozenConfigDict  # every field, as given (read-only; k_policy "auto" resolved)
  drafter: type[Drafter] | None  # the drafter's class; None in autoregressive mode
  drafter_settings: DrafterSettings | None  # what it is checked and built from; None in autoregressive mode
  sampling: SamplingParams  # temperature, top-k, top-p: the config's; static flags serving a run's rows (`covering`)
  k: int  # draft tokens per round: config.k, or the tree's depth
  verify_width: int  # tokens one verify pass feeds: K + 1, or the tree's nodes and root
  policy: k_policy.KPolicy = k_policy.KPolicy()  # how many of the K tokens a round proposes
  tuning: k_policy.Tuning = k_policy.Tuning()  # how a decoder measures the policy's cost table
  # How the target's and the draft model's programs compute, resolved once (`Execution.resolve`, for
  # the platform `lower_only` names, else this one); the draft's is None without a draft model.
  execution: Execution | None = None
  draft_execution: Execution | None = None
  dtype_note: str = ""  # why config.dtype "auto" resolved as it did (the load log says it); "" when given

  @property
  def speculative(self) -> bool:
    return self.drafter is not None

  @property
  def tree(self) -> Tree | DynamicSpec | None:
    return None if self.drafter_settings is None else self.drafter_settings.tree

  @property
  def loads_draft_model(self) -> bool:
    return self.speculative and self.drafter.loads_draft_model

  @property
  def draft_weights(self) -> str:
    """The weight format of the draft model a drafter loads (`loads_draft_model`): its group's `weights`
    when it has one and sets it, else the target's `config.weights`."""
    own = self.drafter_settings.options.get("weights", "") if self.drafter_settings else ""
    return own or self.config.weights

  @property
  def knobs(self) -> Knobs:
    """The config's sampling knobs: those of a request that gives none of its own (`prompts.Request.knobs`)."""
    cfg = self.config
    return Knobs(cfg.temperature, cfg.top_k, cfg.top_p)

  def covering(self, knobs: Sequence[Knobs]) -> DecodeSpec:
    """This spec for a run whose rows sample with `knobs` (each request's own, else the config's):
    sampling's static flags, and so the program, are the ones that serve every row (`SamplingParams.covering`)."""
    return dataclasses.replace(self, sampling=self.sampling.covering(knobs))

  @property
  def drafter_key(self) -> tuple:
    """What a built drafter depends on: its class and settings (a Decoder builds one per key)."""
    return self.drafter, self.drafter_settings

  def program(self, cache_len: int, width: int | None = None) -> tuple:
    """What identifies the compiled program of this spec: every config field but `RUNTIME_FIELDS`,
    the cache length, sampling's static flags and the prompt width. The width shapes the prefill, not
    a round: warming a program up keys it, what the K policy learns of its rounds does not (None)."""
    fields, sampling = self._compiled()
    return json.dumps(fields, sort_keys=True, default=repr), cache_len, *sampling, width

  def description(self, cache_len: int) -> dict[str, Any]:
    """The program's rounds as a stored cost table describes them (`k_policy.cost_store`): `program`
    without the prompt width and the policy's own settings (they choose among the candidates, never
    what one costs), with the drafter's class and what the weight matmuls run on (`matmul = "auto"`
    resolves by what was built and what the CPU has)."""
    fields, sampling = self._compiled()
    cfg = self.config
    return {
        "config": {name: value for name, value in fields.items() if name != "adaptive"}, "cache_len": cache_len,
        "sampling": sampling, "drafter": f"{self.drafter.__module__}.{self.drafter.__qualname__}",
        "matmul": matmul.describe(self.execution.matmul, cfg.dtype, cfg.weights)
    }

  def _compiled(self) -> tuple[dict[str, Any], list]:
    sampling = self.sampling
    fields = {
        name: value for name, value in self.config.as_configdict().to_dict().items() if name not in RUNTIME_FIELDS
    }
    return fields, [sampling.greedy, sampling.use_top_k, sampling.use_top_p, sampling.candidates]


def speculative_fields(cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The fields of `cfg` that only speculative runs read: `SPECULATIVE_FIELDS` and every drafter group."""
  groups = tuple(name for name, value in cfg.items() if isinstance(value, ml_collections.ConfigDict))
  return SPECULATIVE_FIELDS + groups


def get_field(cfg: ml_collections.ConfigDict, path: str) -> Any:
  """The value at a dotted path ("ngram.min")."""
  for name in path.split("."):
    cfg = cfg[name]
  return cfg


def set_field(cfg: ml_collections.ConfigDict, path: str, value: Any) -> None:
  """Sets the value at a dotted path (ml_collections' type checks apply)."""
  *groups, leaf = path.split(".")
  for name in groups:
    cfg = cfg[name]
  cfg[leaf] = value


def unlocked_copy(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `cfg` that takes new fields (the command line's config is locked)."""
  copy = cfg.copy_and_resolve_references()
  copy.unlock()
  return copy


def with_drafter_group(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `cfg` with the config group of the drafter it names added when it lacks it (a drafter
  given by import path); the registered drafters' groups are in `default_config` already."""
  cfg = unlocked_copy(cfg)
  if cfg.get("mode") == "speculative" and isinstance(cfg.get("drafter"), str):
    drafter = registry.resolve(cfg.drafter)
    if drafter.config_key() not in cfg:
      cfg[drafter.config_key()] = drafter.config_group()
  return cfg


def check_fields(cfg: ml_collections.ConfigDict) -> None:
  """Every field of `cfg` is a decode field: a renamed one names its new place, an unknown one its
  closest known names."""
  known = set(decode_config.default_config().keys())
  for name in cfg.keys():
    if name in known or isinstance(cfg[name], ml_collections.ConfigDict):
      continue
    raise ConfigError(
        decode_config.moved(name) or f"unknown config field {name!r}; known fields: {', '.join(sorted(known))}")


def _check_top_level(cfg: ml_collections.ConfigDict) -> SamplingParams:
  def require(ok: bool, message: str) -> None:
    if not ok:
      raise ConfigError(message)

  require(cfg.mode in MODES, f"config.mode must be one of {MODES}, got {cfg.mode!r}")
  require(cfg.dtype in DTYPES, f"config.dtype must be one of {DTYPES}, got {cfg.dtype!r}")
  require(cfg.lower_only in ("",) + lowering.PLATFORMS, f"config.lower_only must be one of "
          f"{lowering.PLATFORMS} (or empty: decode), got {cfg.lower_only!r}")
  try:
    weights = quantized.parse(cfg.weights)
  except quantized.FormatError as error:
    raise ConfigError(f"config.weights: {error}") from None
  require(
      weights is None or not cfg.mesh.strip(), f"config.weights {cfg.weights!r}: quantized weights on a "
      f"mesh (config.mesh {cfg.mesh!r}) are not supported yet")
  require(
      bool(cfg.target), "config.target is empty: give a .gguf file, an HF directory, a registry name or a "
      "hub name org/name[@revision]")
  require(
      int(cfg.k) == cfg.k and cfg.k >= 1, f"config.k (draft tokens per round) must be an integer >= 1, "
      f"got {cfg.k}")
  require(cfg.max_new_tokens >= 1, f"config.max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
  require(cfg.batch_size >= 1, f"config.batch_size must be >= 1, got {cfg.batch_size}")
  require(
      bool(cfg.prompts) or bool(cfg.prompts_file),
      "no prompts: set config.prompts (a tuple of strings) or config.prompts_file")
  for i, prompt in enumerate(() if cfg.prompts_file else cfg.prompts):
    require(isinstance(prompt, str), f"config.prompts[{i}] must be a string, got {type(prompt).__name__} "
            f"{prompt!r}")
  require(cfg.mesh_indivisible in partitioning.INDIVISIBLE, f"config.mesh_indivisible must be one of "
          f"{partitioning.INDIVISIBLE}, got {cfg.mesh_indivisible!r}")
  require(cfg.draft_sharding in DRAFT_SHARDINGS, f"config.draft_sharding must be one of {DRAFT_SHARDINGS}, "
          f"got {cfg.draft_sharding!r}")
  try:
    data = meshes.axis_sizes(cfg.mesh, jax.device_count())[0] if cfg.mesh.strip() else 1
    sampling = sampling_params(cfg.temperature, cfg.top_k, cfg.top_p)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  if cfg.constraint:
    compiler.parse(cfg.constraint)  # a ConfigError naming config.constraint
  require(
      cfg.batch_size % data == 0, f"config.batch_size {cfg.batch_size} does not split over the mesh's "
      f"data axis of size {data}: use a multiple of {data}")
  return sampling


def _execution(cfg: ml_collections.ConfigDict, weights: str, field: str = "") -> Execution:
  """The execution record of a model of `cfg` whose weights are in the format `weights`; a setting that
  cannot apply is a ConfigError naming it (and `field`, the weight format's, when it is not the target's)."""
  try:
    return Execution.resolve(cfg, cfg.dtype, weights, cfg.lower_only or None)
  except ValueError as error:
    raise ConfigError(f"{field} {weights!r}: config.{error}" if field else f"config.{error}") from None


def from_config(cfg: ml_collections.ConfigDict, drafter: Drafter | None = None) -> DecodeSpec:
  """The spec of `cfg`; a `ConfigError` naming the field for anything that cannot work. `drafter`, a
  built Drafter instance, replaces `config.drafter` (its class is still checked against the settings)."""
  cfg = with_drafter_group(cfg) if drafter is None else unlocked_copy(cfg)
  check_fields(cfg)
  sampling = _check_top_level(cfg)
  cfg.dtype, dtype_note = resolve_dtype(cfg.dtype, cfg.matmul, cfg.weights, cfg.lower_only or None)  # what runs
  execution = _execution(cfg, cfg.weights)
  if cfg.mode != "speculative":
    return DecodeSpec(ml_collections.FrozenConfigDict(cfg), None, None, sampling, cfg.k, cfg.k + 1, execution=execution,
                      dtype_note=dtype_note)
  cls = type(drafter) if drafter is not None else registry.resolve(cfg.drafter)
  try:
    tree = parse(cfg.tree)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  options = cfg.adaptive
  try:
    policy = k_policy.parse(cfg.k_policy, options.prior, options.decay, options.recovery,
                            shapes.of(tree).drawn_each_round)
    tuning = k_policy.Tuning.parse(options.calibration_rounds, options.reuse_costs)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  cfg.k_policy = policy.kind  # "auto" resolved: the spec holds what runs
  key = cls.config_key()
  options = cfg[key] if key in cfg else cls.config_group()
  settings = DrafterSettings(group=key, options=ml_collections.FrozenConfigDict(options), draft=cfg.draft, tree=tree,
                             tree_children=cfg.tree_children, k=cfg.k if tree is None else tree.max_depth,
                             plain_rounds=policy.plain_rounds)
  cls.check_config(settings)
  width = cfg.k + 1 if tree is None else tree.nodes_with_root
  spec = DecodeSpec(ml_collections.FrozenConfigDict(cfg), cls, settings, sampling, settings.k, width, policy, tuning,
                    execution, dtype_note=dtype_note)
  if not spec.loads_draft_model:
    return spec
  return dataclasses.replace(spec, draft_execution=_execution(cfg, spec.draft_weights, settings.field("weights")))
