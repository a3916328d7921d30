"""Research sweeps: a grid of decode configs run on models loaded once, one JSONL line per finished point.

  python -m experiments.sweep --config=configs/sweeps/qwen_coder_k.py [--config.field=value ...]

A sweep config (configs/sweeps/) holds `base`, a full decode config as `python -m specjax.decode` takes
it; `axes`, decode field -> tuple of values, whose cartesian product is the grid; `output`, the JSONL
table; `measure_cost` and `cost_repeats`, for the draft/target cost ratio c (`costs.drafter_cost_ratio`:
timed for a draft model through its restricted head when it has one and for a layer-skip draft
through its layers, 0 for n-gram lookup), measured once per drafter setting and batch size.
`drafter` and its settings are axes like any other; a drafter's own settings are named by their dotted
path (`axes.ngram.min = (1, 2)`, `axes.model.vocab = (0, 8192)`). Autoregressive points do not use the
speculative-only fields (k, the drafter, draft, tree and every drafter group: `decode_spec.speculative_fields`):
their
axis values are recorded as null, so the baseline runs once per remaining setting however many K or
drafts the grid has.

Each table row holds the point's axis values (`point`, its identity), the main decode settings as
columns and the full decode config, every stat of `pipeline.run`, c, the theoretical speedup of
Leviathan et al. at the measured alpha_hat (when c is known) and the measured speedup over the point's
autoregressive baseline (the point with the same axis values except mode and the speculative-only ones)
when the table holds it. Rows are appended as soon as a point finishes; a rerun of the same command
skips the points already in the table.

Order: jit caches a compiled program per static shape (models, mode, K, batch size, cache size), while
temperature, top-k, top-p and seed are arrays fed to one program, except that greedy and sampled
decoding, and top-k / top-p on or off, are separate programs (`SamplingParams`' static flags).
Autoregressive baselines run first (so that every speculative row can state its speedup), then points are
grouped by model, then by the other static axes, with the sampling axes innermost, so consecutive points
mostly reuse one program. Hence `compile_time_s` (the time of a point's first, 1-token call) is a real
compile for the first point of each group and for a point that switches one of those flags; for the
others it is one short call.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any, Callable

import ml_collections

from experiments import harness
from specjax import costs, decode_spec, metrics, pipeline, records, session
from specjax.cli import unknown_field
from specjax.models.load import LoadedModel

MODEL_AXES = ("target", "drafter", "draft", "dtype", "mesh")  # which models are loaded, and how: outermost
# Every decode field that changes the loaded models or their layout (points differing in them reload): the
# drafter and mode decide whether a draft model loads.
LOAD_FIELDS = decode_spec.LOAD_FIELDS + ("drafter", "mode")
DYNAMIC_AXES = ("temperature", "top_k", "top_p", "seed")  # sampling axes (mostly one program): innermost
# decode fields copied into every row
SETTINGS = ("target", "drafter", "draft", "mode", "k", "k_policy", "tree", "tree_children", "batch_size", "temperature",
            "top_k", "top_p", "seed", "max_new_tokens", "chat", "dtype", "mesh")

Point = dict[str, Any]  # axis name -> value (null for the speculative-only axes of an autoregressive point)


def _flat(group: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
  """A nested ConfigDict as dotted name -> value."""
  flat = {}
  for name, value in group.items():
    if isinstance(value, ml_collections.ConfigDict):
      flat.update(_flat(value, f"{prefix}{name}."))
    else:
      flat[prefix + name] = value
  return flat


def speculative_only(sweep: ml_collections.ConfigDict, point: Point) -> list[str]:
  """The axes of `point` that autoregressive points do not use (a drafter group's fields included)."""
  fields = decode_spec.speculative_fields(sweep.base)
  return [name for name in point if name.split(".")[0] in fields]


def check_axes(sweep: ml_collections.ConfigDict) -> dict[str, tuple]:
  """The axes of `sweep` (dotted names for a drafter's settings) as tuples; fails, naming the key, on an
  axis that is not a decode field."""
  axes = {}
  for name, values in _flat(sweep.axes).items():
    unknown = unknown_field(sweep.base, name)
    if unknown:
      raise ValueError(f"sweep axis {name!r} is not a field of the base decode config ({unknown})")
    if not isinstance(values, (tuple, list)) or not values:
      raise ValueError(f"sweep axis {name!r} must be a non-empty tuple of values, got {values!r}")
    axes[name] = tuple(values)
  return axes


def point_key(point: Point) -> str:
  """The identity of a point in the table: its axis values as canonical JSON."""
  return json.dumps(point, sort_keys=True)


def _axis_rank(name: str) -> tuple[int, str]:
  return (0 if name in MODEL_AXES else 2 if name in DYNAMIC_AXES else 1, name)


def grid(sweep: ml_collections.ConfigDict) -> list[tuple[Point, ml_collections.ConfigDict]]:
  """Every distinct point of the grid with its decode config, validated, in the run order (above).

  Values are read back through the config, so `temperature=1` and `1.0` are one point."""
  axes = check_axes(sweep)
  names = sorted(axes, key=_axis_rank)
  points = {}
  for values in itertools.product(*(axes[name] for name in names)):
    cfg = decode_spec.with_drafter_group(sweep.base)
    for name, value in zip(names, values):
      try:
        decode_spec.set_field(cfg, name, value)
      except TypeError as error:
        raise ValueError(f"sweep axis {name!r}: value {value!r} does not fit the decode field: {error}") from None
    cfg.output = ""  # the table is the sweep's output
    point = {name: decode_spec.get_field(cfg, name) for name in names}
    try:
      spec = decode_spec.from_config(cfg)
    except ValueError as error:
      raise ValueError(f"sweep point {point}: {error}") from None
    if spec.speculative and spec.tree is not None:  # a tree's K is its depth, whatever the k axis says
      cfg.k = spec.k
      point.update({"k": cfg.k} if "k" in point else {})
    if cfg.mode == "autoregressive":  # one baseline, whatever K and draft came first in the product
      for name in speculative_only(sweep, point):
        point[name] = None
        decode_spec.set_field(cfg, name, decode_spec.get_field(sweep.base, name))
    points.setdefault(point_key(point), (point, cfg))
  return sorted(points.values(), key=lambda point_cfg: point_cfg[1].mode != "autoregressive")


def read_table(path: str) -> list[dict]:
  """The rows already written to a sweep table (none if the file does not exist)."""
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as error:
          raise ValueError(f"{path}:{number}: not a JSON line ({error}); remove or fix it to resume")
  return rows


def baseline_point(sweep: ml_collections.ConfigDict, point: Point) -> Point | None:
  """The autoregressive point that a speculative point is compared with (None without a mode axis)."""
  if "mode" not in point:
    return None
  return {**point, "mode": "autoregressive", **{name: None for name in speculative_only(sweep, point)}}


def make_row(sweep: ml_collections.ConfigDict, point: Point, cfg: ml_collections.ConfigDict, stats: dict,
             c: float | None, table: list[dict]) -> dict:
  """One table row: axes, settings, `pipeline.run` stats, c, the theoretical and measured speedups,
  machine and command."""
  speculative = cfg.mode == "speculative"
  row = {"point": point, **{field: cfg[field] for field in SETTINGS}, **stats}
  if not speculative:
    row.update({field: None for field in decode_spec.speculative_fields(sweep.base) if field in row})
  alpha = stats.get("alpha_hat")
  row["cost_ratio_c"] = c
  row["theoretical_speedup"] = (
      metrics.theoretical_speedup(alpha, cfg.k, c)  # a chain's theory, not a tree's
      if c is not None and alpha is not None and not cfg.tree.strip() else None)
  baseline = baseline_point(sweep, point) if speculative else None
  by_key = {point_key(r["point"]): r for r in table}
  ar_row = by_key.get(point_key(baseline)) if baseline else None
  row["autoregressive_tokens_per_second"] = ar_row["tokens_per_second"] if ar_row else None
  row["speedup_vs_autoregressive"] = (stats["tokens_per_second"] / ar_row["tokens_per_second"] if ar_row else None)
  row["config"] = cfg.to_dict()  # the full decode config of the point
  row["environment"] = records.environment()
  row["command"] = records.command()
  return row


def _describe(point: Point) -> str:
  return " ".join(f"{name}={value}" for name, value in point.items() if value is not None)


def _summary(row: dict) -> str:
  fmt = lambda x, spec=".3f": harness.number(x, spec)
  text = f"{row['tokens_per_second']:.2f} tok/s, compile {row['compile_time_s']:.1f} s"
  if row["mode"] == "speculative":
    text += (f", acceptance {fmt(row['acceptance_rate'])}, alpha_hat {fmt(row['alpha_hat'])}, "
             f"speedup {fmt(row['speedup_vs_autoregressive'], '.2f')} "
             f"(theory {fmt(row['theoretical_speedup'], '.2f')})")
  return text


def run(sweep: ml_collections.ConfigDict, log: Callable[[str], None] = print) -> list[dict]:
  """Runs the points of `sweep` missing from its table, appending one row each; returns those rows."""
  if not sweep.output:
    raise ValueError("config.output (the JSONL table) is empty")
  points = grid(sweep)
  table = read_table(sweep.output)
  done = {point_key(row["point"]) for row in table}
  todo = [(point, cfg) for point, cfg in points if point_key(point) not in done]
  if len(todo) < len(points):
    log(f"skipping {len(points) - len(todo)} of {len(points)} points already in {sweep.output}")
  if not todo:
    log("nothing to run")
    return []
  os.makedirs(os.path.dirname(sweep.output) or ".", exist_ok=True)

  loaded: dict[tuple, tuple[LoadedModel, LoadedModel | None]] = {}

  def models(cfg: ml_collections.ConfigDict) -> tuple[LoadedModel, LoadedModel | None]:
    """The point's (target, draft or None), loaded as `pipeline.load_models` does (mesh and execution
    settings included); one pair in memory at a time, reused while the load fields stay the same."""
    key = tuple(cfg[field] for field in LOAD_FIELDS)  # top-level fields
    if key not in loaded:
      loaded.clear()
      loaded[key] = pipeline.load_models(cfg, lambda message: log(f"  {message}"))
    return loaded[key]

  costs_measured = {}

  def cost_ratio(cfg: ml_collections.ConfigDict, pair: tuple[LoadedModel, LoadedModel | None]) -> float:
    """The drafter's c at the point's batch size, measured once per drafter setting (its group)."""
    spec = decode_spec.from_config(cfg)
    settings = spec.drafter_settings
    described = {
        "target": cfg.target, "drafter": cfg.drafter, "draft": cfg.draft, "dtype": cfg.dtype,
        "batch_size": cfg.batch_size, settings.group: settings.options.to_json()
    }
    key = point_key(described)
    if key not in costs_measured:
      drafter = session.build_drafter(spec, *pair, log).drafter
      costs_measured[key] = costs.drafter_cost_ratio(drafter, pair[0], cfg.batch_size, sweep.cost_repeats)
      log(f"cost ratio c = {costs_measured[key]:.3f} (drafter {cfg.drafter}: {_describe(described)})")
    return costs_measured[key]

  written = []
  for number, (point, cfg) in enumerate(todo, 1):
    log(f"[{number}/{len(todo)}] {_describe(point)}")
    pair = models(cfg)
    speculative = cfg.mode == "speculative"
    c = cost_ratio(cfg, pair) if sweep.measure_cost and speculative else None
    result = pipeline.run(cfg, log=lambda message: log(f"  {message}"), models=pair)
    row = make_row(sweep, point, cfg, result["stats"], c, table)
    with open(sweep.output, "a") as f:
      f.write(json.dumps(row) + "\n")
    table.append(row)
    written.append(row)
    log(f"[{number}/{len(todo)}] {_summary(row)}")
  log(f"wrote {len(written)} rows to {sweep.output}")
  return written


def main(sweep: ml_collections.ConfigDict) -> None:
  run(sweep, log=harness.log)


if __name__ == "__main__":
  harness.run_script(main, "Sweep config file (see configs/sweeps/).")
