"""Figures from a sweep table (`experiments/sweep.py`), as PNG files.

  python -m experiments.plots --config=configs/reports/plots.py:qwen_coder_k
  python -m experiments.plots --config=configs/reports/plots.py --config.table=TABLE.jsonl --config.output=DIR \
      [--config.k=K] [--config.labels='("DRAFT=NAME", ...)']

  acceptance_vs_k.png          acceptance rate and mean accepted length vs K
  speedup_vs_k.png             measured speedup over the autoregressive baseline (solid) and the
                               theoretical one at the measured alpha_hat and c (dashed) vs K
  per_position_acceptance.png  acceptance rate at draft positions 1..K, for one K
  speedup_vs_batch.png         measured (solid) and theoretical (dashed) speedup vs batch size
  distillation.png             acceptance rate and mean accepted length per draft (bars), e.g. a draft
                               before and after distillation

Lines (or bar groups) are the settings of the table's other axes (temperature, draft, ...). A figure whose
axis has fewer than two values in the table, or whose values are missing, is skipped with a message.
`k` picks the K of the per-position and per-draft figures (0: the largest K in the table); `labels`
name drafts (axis values such as paths) in legends and bars. configs/reports/plots.py holds the fields.
"""

from __future__ import annotations

import os
from typing import Callable

import matplotlib
import ml_collections

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)

from experiments import harness  # noqa: E402
from experiments.sweep import read_table  # noqa: E402
from specjax.errors import ConfigError  # noqa: E402


class Skip(Exception):
  """A figure that the table cannot support; the message says what is missing."""


class Table:
  """The speculative rows of a sweep table and how to label them."""
  def __init__(self, rows: list[dict], labels: dict[str, str], k: int | None):
    self.rows = [r for r in rows if r["mode"] == "speculative"]
    self.labels = labels
    ks = sorted({r["k"] for r in self.rows})
    self.k = k if k is not None else (ks[-1] if ks else None)

  def axis_values(self, rows: list[dict], name: str) -> list:
    """The distinct values of axis `name` among `rows`, in the table's order."""
    return list(dict.fromkeys(r["point"][name] for r in rows if name in r["point"]))

  def need_axis(self, name: str, rows: list[dict] | None = None) -> list[dict]:
    """The rows that vary along axis `name`; raises Skip unless it has two values or more."""
    rows = self.rows if rows is None else rows
    if len(self.axis_values(rows, name)) < 2:
      raise Skip(f"needs a '{name}' axis with two values or more among the speculative rows")
    return rows

  def at_k(self) -> list[dict]:
    rows = [r for r in self.rows if r["k"] == self.k]
    if not rows:
      raise Skip(f"no speculative rows at K = {self.k}")
    return rows

  def label(self, name: str, value) -> str:
    if name == "draft":
      return self.labels.get(value, os.path.basename(str(value).rstrip("/")))
    return f"{name}={value}"

  def groups(self, rows: list[dict], *varying: str) -> dict[str, list[dict]]:
    """Rows grouped by the values of every other axis (mode excluded), labelled by those values."""
    names = {n for row in rows for n in row["point"] if n not in varying and n != "mode"}
    shown = sorted(n for n in names if len(self.axis_values(rows, n)) > 1)  # constant axes say nothing
    groups: dict[str, list[dict]] = {}
    for row in rows:
      name = ", ".join(self.label(n, row["point"].get(n)) for n in shown) or "all"
      groups.setdefault(name, []).append(row)
    return groups


def _lines(ax, groups: dict[str, list[dict]], x: str, y: str, style: str = "-o",
           labelled: set[str] | None = None) -> int:
  """One line per group (colour C<i> for the i-th group) of y against x, points with y missing left out;
  a group is named in the legend once (`labelled` collects the names across calls). Returns the lines
  drawn."""
  labelled = set() if labelled is None else labelled
  drawn = 0
  for index, (name, rows) in enumerate(groups.items()):
    points = sorted((r[x], r[y]) for r in rows if r.get(y) is not None)
    if points:
      ax.plot([p[0] for p in points], [p[1] for p in points], style, color=f"C{index}",
              label=None if name in labelled else name)
      labelled.add(name)
      drawn += 1
  ax.set_xticks(sorted({r[x] for rows in groups.values() for r in rows}))  # the swept values
  return drawn


def save_figure(fig, out_dir: str, name: str) -> str:
  path = os.path.join(out_dir, name)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def acceptance_vs_k(table: Table, out_dir: str) -> str:
  groups = table.groups(table.need_axis("k"), "k")
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  _lines(left, groups, "k", "acceptance_rate")
  _lines(right, groups, "k", "mean_accepted_length")
  left.set(xlabel="K (draft tokens per round)", ylabel="acceptance rate (accepted / proposed)", ylim=(0, 1.05))
  right.set(xlabel="K (draft tokens per round)", ylabel="mean accepted length (tokens per round)")
  left.legend(fontsize=8)
  return save_figure(fig, out_dir, "acceptance_vs_k.png")


def _speedup(table: Table, out_dir: str, x: str, xlabel: str, name: str) -> str:
  groups = table.groups(table.need_axis(x), x)
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  labelled: set[str] = set()
  drawn = _lines(ax, groups, x, "speedup_vs_autoregressive", "-o", labelled)
  drawn += _lines(ax, groups, x, "theoretical_speedup", "--x", labelled)
  if not drawn:
    plt.close(fig)
    raise Skip("no speedups in the table (no autoregressive baseline points and no cost ratio c)")
  ax.axhline(1.0, color="gray", linewidth=0.8)
  ax.set(xlabel=xlabel, ylabel="speedup over autoregressive decoding",
         title="measured (solid, o) and theoretical (dashed, x)")
  ax.legend(fontsize=8)
  return save_figure(fig, out_dir, name)


def speedup_vs_k(table: Table, out_dir: str) -> str:
  return _speedup(table, out_dir, "k", "K (draft tokens per round)", "speedup_vs_k.png")


def speedup_vs_batch(table: Table, out_dir: str) -> str:
  return _speedup(table, out_dir, "batch_size", "batch size", "speedup_vs_batch.png")


def per_position_acceptance(table: Table, out_dir: str) -> str:
  groups = table.groups(table.at_k(), "k")
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for index, (name, rows) in enumerate(groups.items()):
    rates_K = rows[0]["per_position_acceptance"]  # one row per group: every other axis is fixed
    positions = [i + 1 for i, rate in enumerate(rates_K) if rate is not None]
    ax.plot(positions, [rate for rate in rates_K if rate is not None], "-o", color=f"C{index}", label=name)
  ax.set(xlabel="draft position", ylabel="acceptance rate given the position was reached", title=f"K = {table.k}",
         ylim=(0, 1.05), xticks=range(1, table.k + 1))
  ax.legend(fontsize=8)
  return save_figure(fig, out_dir, "per_position_acceptance.png")


def distillation(table: Table, out_dir: str) -> str:
  rows = table.need_axis("draft", table.at_k())
  drafts = table.axis_values(rows, "draft")
  groups = table.groups(rows, "draft", "k")
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  width = 0.8 / len(groups)
  for ax, field, ylabel in ((axes[0], "acceptance_rate", "acceptance rate"), (axes[1], "mean_accepted_length",
                                                                              "mean accepted length")):
    for index, (name, group) in enumerate(groups.items()):
      by_draft = {r["draft"]: r[field] for r in group}
      values = [float("nan") if by_draft.get(d) is None else by_draft[d] for d in drafts]  # nan: no bar
      ax.bar([i + index * width for i in range(len(drafts))], values, width, label=name, color=f"C{index}")
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(drafts))],
                  [table.label("draft", d) for d in drafts])
    ax.set(ylabel=ylabel, title=f"K = {table.k}")
  axes[0].legend(fontsize=8)
  return save_figure(fig, out_dir, "distillation.png")


FIGURES: tuple[Callable[[Table, str], str],
               ...] = (acceptance_vs_k, speedup_vs_k, per_position_acceptance, speedup_vs_batch, distillation)


def plot_all(rows: list[dict], out_dir: str, k: int | None = None, labels: dict[str, str] | None = None,
             log: Callable[[str], None] = print) -> list[str]:
  """Writes every figure the table supports into `out_dir`; returns their paths."""
  table = Table(rows, labels or {}, k)
  os.makedirs(out_dir, exist_ok=True)
  written = []
  for figure in FIGURES:
    try:
      if not table.rows:
        raise Skip("the table has no speculative rows")
      written.append(figure(table, out_dir))
      log(f"wrote {written[-1]}")
    except Skip as reason:
      log(f"skipped {figure.__name__}: {reason}")
  return written


def main(cfg: ml_collections.ConfigDict) -> None:
  for field in ("table", "output"):
    if not cfg[field]:
      raise ConfigError(f"config.{field} is empty (configs/reports/plots.py:<sweep> names both)")
  bad = [label for label in cfg.labels if "=" not in label]
  if bad:
    raise ConfigError(f"config.labels: {bad} not of the form DRAFT=NAME")
  labels = dict(label.split("=", 1) for label in cfg.labels)
  plot_all(read_table(cfg.table), cfg.output, cfg.k or None, labels)


if __name__ == "__main__":
  harness.run_script(main, "Plots config (configs/reports/plots.py).")
