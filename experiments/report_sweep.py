"""A markdown table of a sweep table (`experiments/sweep.py`), so reports quote the JSONL, never retype it.

  python -m experiments.report_sweep --config=configs/reports/sweep.py:qwen_coder_k
  python -m experiments.report_sweep --config=configs/reports/sweep.py --config.table=TABLE.jsonl
"""

from __future__ import annotations

import ml_collections

from experiments import harness
from experiments.sweep import read_table
from specjax.errors import ConfigError

COLUMNS = (  # (header, row field, digits)
    ("mode", "mode", None), ("batch", "batch_size", None), ("K", "k", None), ("drafter", "drafter", None),
    ("draft", "draft", None), ("draft head", "draft_vocab", None), ("temperature", "temperature", 1),
    ("tokens/s", "tokens_per_second", 2), ("speedup", "speedup_vs_autoregressive", 2), ("theory", "theoretical_speedup",
                                                                                        2), ("c", "cost_ratio_c", 3),
    ("α̂", "alpha_hat", 3), ("acceptance rate", "acceptance_rate", 3), ("mean accepted length", "mean_accepted_length",
                                                                        2), ("compile s", "compile_time_s", 1))


def _cell(row: dict, field: str, digits: int | None) -> str:
  value = row.get(field, row.get("config", {}).get(field))  # fields that were no axis: the decode config's
  drafter = row.get("drafter", row.get("config", {}).get("drafter", "model"))  # rows older than drafters: model
  if field == "drafter":
    return drafter if row["mode"] == "speculative" else ""
  if value is None or (field in ("draft", "draft_vocab") and (row["mode"] != "speculative" or drafter != "model")):
    return ""
  if field == "draft_vocab":
    return "all" if value == 0 else str(value)
  return f"{value:.{digits}f}" if digits is not None else str(value)


def markdown(rows: list[dict]) -> str:
  """The table's rows, one line each, in the order they were run."""
  env = rows[0]["environment"] if rows else {}
  lines = [
      f"Command: `{rows[0]['command']}`  " if rows else "",
      f"Machine: {env.get('processor')}, {env.get('platform')}, backend {env.get('backend')}; "
      f"jax {env.get('jax')}, flax {env.get('flax')}.", "",
      "| " + " | ".join(header for header, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)
  ]
  for row in rows:
    lines.append("| " + " | ".join(_cell(row, field, digits) for _, field, digits in COLUMNS) + " |")
  return "\n".join(lines)


def main(cfg: ml_collections.ConfigDict) -> None:
  if not cfg.table:
    raise ConfigError("config.table is empty: name the sweep (configs/reports/sweep.py:<sweep>) or the table")
  print(markdown(read_table(cfg.table)))


if __name__ == "__main__":
  harness.run_script(main, "Report config (configs/reports/sweep.py).")
