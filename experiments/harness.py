"""What every experiment script shares: its command line, its log, its numbers and its results file.

A script's command line is absl + an `ml_collections` config file under `configs/` (`run_script`: the
`--config=FILE` flag and its `--config.FIELD=VALUE` overrides, through `specjax.cli.run`, which reports
a bad value in one `error:` line). Its results are one JSON file that records, besides the numbers, the
command that made it and the machine and library versions (`write_results`). A benchmark whose config
has a `report` field prints the tables of an earlier results file instead of running
(`report_or_run`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

import ml_collections

from specjax import cli, records

Log = Callable[[str], None]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


def log(message: str) -> None:
  """Prints `message` at once, time-stamped (runs take minutes to hours)."""
  print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def number(x: Any, spec: str = ".2f", missing: str = "n/a") -> str:
  """`x` formatted with `spec` for a table or a log line; `missing` ("n/a") when it is None."""
  return missing if x is None else format(x, spec)


def write_results(results: dict, path: str) -> None:
  """Writes `results` to `path` as indented JSON, adding the command (`records.command`: from the
  repository root) and the machine and versions (`records.environment`) unless it holds them already.
  Makes the directory; writes through a temporary file, so that a run killed while writing leaves the
  previous version, never half a file."""
  results.setdefault("command", records.command())
  results.setdefault("environment", records.environment())
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  temporary = f"{path}.tmp{os.getpid()}"
  try:
    with open(temporary, "w") as f:
      json.dump(results, f, indent=1)
    os.replace(temporary, path)
  finally:
    if os.path.exists(temporary):
      os.unlink(temporary)


def provenance(results: dict) -> list[str]:
  """The markdown lines that say how a results file was made: its command, machine and versions."""
  env = results["environment"]
  versions = f"jax {env['jax']}, flax {env['flax']}, transformers {env['transformers']}"
  versions += f", torch {env['torch']}" if "torch" in env else ""
  return [
      f"Command: `{results['command']}`  ",
      f"Machine: {env['processor']}, {env['platform']}, backend {env['backend']}; {versions}."
  ]


def read_results(path: str, field: str = "report") -> dict:
  """A results file written by `write_results`; a file that is not JSON fails naming `config.<field>`."""
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"config.{field} {path}: not a results file ({e})") from None


def report_or_run(cfg: ml_collections.ConfigDict, run: Callable[..., dict], render: Callable[[dict], str]) -> None:
  """A benchmark's `main`: prints `render` of the results file `cfg.report` when one is named, else runs
  `run(cfg, log=log)` and prints `render` of the results it returns."""
  if cfg.report:
    print(render(read_results(cfg.report)))
    return
  results = run(cfg, log=log)
  print("\n" + render(results), flush=True)


def run_child(module: str, config_file: str, overrides: dict[str, Any],
              env: dict[str, str] | None = None) -> tuple[dict | None, str]:
  """Runs `python -m <module> --config=<config_file> --config.FIELD=VALUE ...` (`overrides`) in a fresh
  process from the repository root (a measurement that needs its own memory, compile caches, devices or
  XLA flags); returns (the JSON object the last line of its output holds, or None if it failed; its
  stderr)."""
  command = [
      sys.executable, "-m", module, f"--config={os.path.join(ROOT, config_file)}",
      *(f"--config.{field}={value}" for field, value in overrides.items())
  ]
  done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
  if done.returncode:
    return None, done.stderr
  return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def run_script(main: Callable[[ml_collections.ConfigDict], None], config_help: str) -> None:
  """The command line of an experiment script: defines `--config` (`config_help` names the config files)
  and calls `main(config)` through `specjax.cli.run`. Call it under `if __name__ == "__main__":` so that
  the flag is defined only when the script runs, and tests can import the script next to other absl
  command lines."""
  from ml_collections import config_flags

  config = config_flags.DEFINE_config_file("config", None, config_help, lock_config=True)
  cli.run(main, config)
