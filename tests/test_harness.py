"""`experiments.harness`, what every experiment script shares: the "n/a" number, the results writer, the
report-or-run `main`, and the command line; and every config of configs/benchmarks/ and configs/reports/
(variants included) loads as the command line loads it."""

import glob
import json
import os
import subprocess
import sys

import ml_collections
import pytest

from experiments import benchmark_decode, harness
from specjax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_number_formats_or_says_n_a():
  assert harness.number(1.23456) == "1.23"
  assert harness.number(0.5, ".3f") == "0.500"
  assert harness.number(None) == "n/a"
  assert harness.number(None, ".1f", missing="") == ""
  assert harness.number(7, "d") == "7"


def test_write_results_records_command_and_machine_and_replaces_whole_files(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(sys.modules["__main__"], "__spec__", None)  # run as a script
  monkeypatch.setattr(sys, "argv", ["experiments/x.py", f"--config.output={ROOT}/experiments/results/x.json"])
  path = tmp_path / "new" / "dir" / "results.json"  # directories are made
  results = {"numbers": [1, 2]}
  harness.write_results(results, str(path))
  written = json.loads(path.read_text())
  assert written["numbers"] == [1, 2]
  assert written["command"].endswith("experiments/x.py --config.output=experiments/results/x.json")
  assert {"jax", "flax", "transformers", "backend", "platform"} <= set(written["environment"])
  results.update(numbers=[3], command="kept", environment={"device_kind": "kept"})  # never overwritten
  harness.write_results(results, str(path))
  assert json.loads(path.read_text()) == {"numbers": [3], "command": "kept", "environment": {"device_kind": "kept"}}
  assert os.listdir(path.parent) == ["results.json"]  # no temporary file left
  with pytest.raises(TypeError):  # a value JSON cannot hold: the previous file stays whole
    harness.write_results({"bad": object(), "command": "", "environment": {}}, str(path))
  assert json.loads(path.read_text())["numbers"] == [3] and os.listdir(path.parent) == ["results.json"]


def test_report_or_run_prints_a_results_file_or_runs(tmp_path, capsys):
  report = tmp_path / "results.json"
  report.write_text(json.dumps({"value": 2}))
  render = lambda results: f"value {results['value']}"
  run = lambda cfg, log: log("ran") or {"value": 3}
  harness.report_or_run(_config(report=str(report)), run, render)
  assert capsys.readouterr().out == "value 2\n"
  harness.report_or_run(_config(report=""), run, render)
  out = capsys.readouterr().out
  assert "] ran\n" in out and out.endswith("\nvalue 3\n")  # a time-stamped log, then the tables
  report.write_text("{not json")
  with pytest.raises(ValueError, match="config.report .*: not a results file"):
    harness.report_or_run(_config(report=str(report)), run, render)


def _config(**fields) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(fields)


def _config_arguments() -> list[str]:
  """Every config file of configs/benchmarks/ and configs/reports/, with each named variant."""
  arguments = []
  for path in sorted(
      glob.glob(os.path.join(ROOT, "configs", "benchmarks", "[!_]*.py")) +
      glob.glob(os.path.join(ROOT, "configs", "reports", "[!_]*.py"))):
    name = os.path.basename(path)
    if name != "distill.py":  # names its run always (below)
      arguments.append(path)
    variants = {
        "plots.py": ("qwen_coder_k", "qwen_coder_batch", "smollm2_distill", "smollm2_eagle"),
        "sweep.py": ("qwen_coder_k",), "trees.py": ("qwen", "ngram"), "distill.py":
            ("distill_smollm2", "distill_eagle_smollm2"), "accelerator.py": ("tiny",), "drafters.py": ("tiny",)
    }.get(name, ())
    arguments += [f"{path}:{variant}" for variant in variants]
  return arguments


@pytest.mark.parametrize("argument", _config_arguments(), ids=lambda a: os.path.relpath(a, ROOT))
def test_every_experiment_config_loads(argument):
  assert cli.load_config_file(argument)


def test_a_distillation_report_config_names_its_run():
  with pytest.raises(ValueError, match="run must be one of distill_smollm2, distill_eagle_smollm2"):
    cli.load_config_file(os.path.join(ROOT, "configs", "reports", "distill.py"))
  cfg = cli.load_config_file(os.path.join(ROOT, "configs", "reports", "distill.py:distill_smollm2"))
  assert cfg.workdir == "experiments/distill_smollm2/workdir"
  assert cfg.output == "experiments/distill_smollm2/results.json"


def test_plots_preset_names_the_committed_figures():
  cfg = cli.load_config_file(os.path.join(ROOT, "configs", "reports", "plots.py:smollm2_distill"))
  assert cfg.table == "experiments/results/sweep_smollm2_distill.jsonl" and cfg.k == 1
  assert cfg.output == "experiments/results/plots/smollm2_distill"
  assert [label.split("=")[1] for label in cfg.labels] == ["undistilled", "distilled"]


def test_decode_report_renders_a_committed_results_file():
  with open(os.path.join(ROOT, "experiments", "results", "decode_cpu_float32.json")) as f:
    text = benchmark_decode.tables(json.load(f))
  row = "| specjax_speculative | 1 | 5 | all | 6.42 | 1.42 | 2.10 | 1.57 | 0.947 | 0.868 | 5.34 | 37.2 | yes |"
  assert row in text
  assert "| specjax_speculative | 4 | 4 | all | 7.09 | 0.96 | 2.02 | n/a |" in text  # no batch-4 verify cost
  assert "| transformers_generate | 4 | 2.88 | yes | n/a |" in text


def test_a_report_without_its_input_fails_in_one_line():
  done = subprocess.run([sys.executable, "-m", "experiments.report_sweep", "--config=configs/reports/sweep.py"],
                        cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 2 and done.stderr.strip().startswith("error: config.table is empty"), done.stderr
