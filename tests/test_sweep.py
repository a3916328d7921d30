"""`experiments.sweep` on tiny HF models (run, resume, config errors) and `experiments.plots` on a fixture
table. The sweep runs in this process so that its compiled programs are reused across the tests."""

import glob
import importlib
import json
import os
import shutil
import subprocess
import sys

import ml_collections
import pytest

from configs.sweeps import tiny
from experiments import plots, report_sweep, report_trees, sweep
from specjax import metrics, pipeline
from tests.helpers.tiny_hf import save_char_tokenizer, save_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC_POINT = {"k": 2, "mode": "speculative"}
AR_POINT = {"k": None, "mode": "autoregressive"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
  """Target and draft directories holding the same weights, so that greedy drafts are all accepted."""
  dirs = []
  for name in ("target", "draft"):
    directory = str(tmp_path_factory.mktemp(name))
    save_hf_model("qwen2", directory, seed=0)
    save_char_tokenizer(directory)
    dirs.append(directory)
  return dirs


def _sweep(model_dirs, output: str) -> ml_collections.ConfigDict:
  cfg = tiny.get_config()
  cfg.base.target, cfg.base.draft = model_dirs
  cfg.output = output
  return cfg


def _lines(path) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f]


class _CountingRun:
  """Stands in for pipeline.run and counts its calls."""
  def __init__(self):
    self.calls, self._run = 0, pipeline.run

  def __call__(self, *args, **kwargs):
    self.calls += 1
    return self._run(*args, **kwargs)


@pytest.fixture(scope="module")
def finished_table(model_dirs, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("sweep") / "table.jsonl")
  messages = []
  written = sweep.run(_sweep(model_dirs, path), log=messages.append)
  return path, written, messages


@pytest.mark.slow
def test_two_point_sweep_writes_rows_consistent_with_pipeline_run(model_dirs, finished_table):
  path, written, messages = finished_table
  ar, spec = _lines(path)
  assert json.loads(json.dumps(written)) == [ar, spec]  # the autoregressive baseline runs first
  assert (ar["point"], spec["point"]) == (AR_POINT, SPEC_POINT)
  assert any(m.startswith("[2/2]") for m in messages)
  for column in ("tokens_per_second", "wall_time_s", "compile_time_s", "acceptance_rate", "alpha_hat",
                 "mean_accepted_length", "per_position_acceptance", "target_calls", "draft_calls", "cost_ratio_c",
                 "theoretical_speedup", "speedup_vs_autoregressive", "batch_size", "k", "temperature", "draft",
                 "target", "config", "environment", "command"):
    assert column in spec, column
  assert ar["k"] is None and ar["draft"] is None and ar["speedup_vs_autoregressive"] is None

  cfg = _sweep(model_dirs, path).base
  cfg.k = 2
  direct = pipeline.run(cfg, log=lambda m: None)["stats"]  # the same point, outside the sweep
  for field in ("generated_tokens", "acceptance_rate", "alpha_hat", "mean_accepted_length", "per_position_acceptance",
                "target_calls", "draft_calls", "acceptance"):
    assert spec[field] == direct[field], field
  assert spec["acceptance_rate"] == 1.0 and len(spec["per_position_acceptance"]) == 2  # same weights
  assert spec["cost_ratio_c"] > 0
  assert spec["theoretical_speedup"] == pytest.approx(metrics.theoretical_speedup(1.0, 2, spec["cost_ratio_c"]))
  assert spec["speedup_vs_autoregressive"] == pytest.approx(spec["tokens_per_second"] / ar["tokens_per_second"])


@pytest.mark.slow
def test_drafter_is_an_axis(model_dirs, tmp_path):
  """A sweep over `drafter`: one autoregressive baseline for all of them, each drafter's c (0 for the
  n-gram lookup, a timed ratio for the others), greedy outputs equal to the baseline's, and a report
  that names the drafter (and the draft model only for the model drafter)."""
  cfg = _sweep(model_dirs, str(tmp_path / "drafters.jsonl"))
  cfg.axes.drafter = ("model", "ngram", "layer_skip")
  cfg.base.layer_skip.layers = "0"
  rows = sweep.run(cfg, log=lambda m: None)
  by_drafter = {row["point"]["drafter"]: row for row in rows}
  assert set(by_drafter) == {None, "model", "ngram", "layer_skip"}  # None: the shared baseline
  assert by_drafter["ngram"]["cost_ratio_c"] == 0.0 and by_drafter["ngram"]["draft_calls"] == 0
  assert 0 < by_drafter["layer_skip"]["cost_ratio_c"] and 0 < by_drafter["model"]["cost_ratio_c"]
  baseline = by_drafter[None]
  for name in ("model", "ngram", "layer_skip"):
    row = by_drafter[name]
    assert row["drafter"] == name and row["autoregressive_tokens_per_second"] == baseline["tokens_per_second"]
    assert row["generated_tokens"] == baseline["generated_tokens"]
  table = report_sweep.markdown(rows).splitlines()
  header = [cell.strip() for cell in table[3].split("|")]
  drafter_at, draft_at = header.index("drafter"), header.index("draft")
  cells = {line.split("|")[drafter_at].strip(): line.split("|")[draft_at].strip() for line in table[5:]}
  assert cells["ngram"] == cells["layer_skip"] == "" and cells["model"] == model_dirs[1]


@pytest.mark.slow
def test_tree_is_an_axis_whose_k_is_its_depth(model_dirs, tmp_path):
  """A sweep over `tree` x `k`: a tree's K is its depth (one point per tree, however many K), chains keep
  the k axis; greedy outputs equal the baseline's; the tree report summarises the rows and its
  predictions follow from the measured forward costs (a stand-in table of seconds here)."""
  cfg = _sweep(model_dirs, str(tmp_path / "trees.jsonl"))
  cfg.axes.k = (1, 3)
  cfg.axes.tree = ("", "(2, 1)")
  rows = sweep.run(cfg, log=lambda m: None)
  points = sorted((row["point"]["tree"] or "", row["point"]["k"] or 0) for row in rows)
  assert points == [("", 0), ("", 1), ("", 3), ("(2, 1)", 2)]
  tree_row = next(row for row in rows if row["point"]["tree"] == "(2, 1)")
  assert tree_row["k"] == 2 and tree_row["nodes_verified_per_round"] == 5 and tree_row["theoretical_speedup"] is None
  assert {row["generated_tokens"] for row in rows} == {rows[0]["generated_tokens"]}
  summary = report_trees.summarize_row(tree_row)
  assert (summary["nodes"], summary["depth"], summary["draft_widths"]) == (4, 2, [1, 2, 2])
  assert summary["accepted_per_round"] == pytest.approx(tree_row["mean_accepted_length"] - 1)
  seconds = {"target": {1: 1.0, 5: 2.0}, "draft": {1: 0.25, 2: 0.5}}
  report_trees.predict(summary, seconds)
  assert summary["predicted_cpu"] == pytest.approx(summary["tokens_per_round"] / 3.25)
  assert summary["predicted_accelerator"] == pytest.approx(summary["tokens_per_round"] /
                                                           (1 + 0.25 * summary["draft_passes_per_round"]))
  # The kit's measured verify costs (a results file's shape): a 5-token verify at batch 2 interpolated
  # between 3 and 9 tokens, c from the kit; a row past the widths measured gets no prediction.
  kit_results = {
      "costs": [{"prompt_tokens": 8, "batch_size": 2, "cost_ratio_c": 0.1}],
      "verify_costs": [{"prompt_tokens": 8, "batch_size": 2, "in_target_steps": {"1": 1.0, "3": 1.2, "9": 2.4}}]
  }
  measured = report_trees.accelerator_costs(kit_results)
  report_trees.predict_measured_accelerator(summary, measured)
  assert summary["batch_size"] <= 2
  assert summary["predicted_measured_accelerator"] == pytest.approx(summary["tokens_per_round"] /
                                                                    (1.6 + 0.1 * summary["draft_passes_per_round"]))
  for beyond in (dict(summary, nodes=9), dict(summary, batch_size=4)):  # 10 tokens; a batch the kit lacks
    report_trees.predict_measured_accelerator(beyond, measured)
    assert beyond["predicted_measured_accelerator"] is None
  assert "| measured accelerator costs |" in report_trees.markdown([summary])
  summaries = [report_trees.summarize_row(row) for row in rows if row["mode"] == "speculative"]
  figure = report_trees.figure(summaries, summary["batch_size"], str(tmp_path / "trees.png"))
  assert open(figure, "rb").read().startswith(b"\x89PNG")
  comparison = report_trees.comparison(summaries, 0.0, summary["batch_size"])
  assert comparison["tree"] == "tree (2, 1)" and comparison["chain"] == "chain K=3"  # no chain of 4 nodes


def test_tree_report_counts_each_drafters_passes():
  """Draft passes per round as the drafters run them: a dynamic tree's root and D - 1 frontiers of b, a
  static tree's levels plus the leaves for a draft model (not for an EAGLE head), none for a lookup."""
  row = lambda tree, drafter: {"tree": tree, "drafter": drafter, "k": 0, "draft_calls": 0, "target_calls": 1}
  assert report_trees.draft_widths(row("dynamic(16, 6, 4)", "model")) == [1, 4, 4, 4, 4, 4]
  assert report_trees.draft_widths(row("(2, 1)", "model")) == [1, 2, 2]
  assert report_trees.draft_widths(row("(2, 1)", "eagle")) == [1, 2]
  assert report_trees.draft_widths(row("(2, 1)", "ngram")) == []
  assert report_trees.label(row(str([[0] * d for d in range(1, 9)]), "model")) == "paths N=8 D=8"


def test_rerun_skips_finished_points(model_dirs, finished_table, monkeypatch):
  path, _, _ = finished_table
  before = open(path).read()
  counting = _CountingRun()
  monkeypatch.setattr(pipeline, "run", counting)
  messages = []
  assert sweep.run(_sweep(model_dirs, path), log=messages.append) == []
  assert counting.calls == 0 and open(path).read() == before
  assert f"skipping 2 of 2 points already in {path}" in messages


def test_partial_table_resumes_with_the_missing_point(model_dirs, finished_table, tmp_path, monkeypatch):
  path = str(tmp_path / "partial.jsonl")
  with open(finished_table[0]) as f:
    ar_line = f.readline()
  with open(path, "w") as f:
    f.write(ar_line)
  counting = _CountingRun()
  monkeypatch.setattr(pipeline, "run", counting)
  messages = []
  written = sweep.run(_sweep(model_dirs, path), log=messages.append)
  assert counting.calls == 1 and [r["point"] for r in written] == [SPEC_POINT]
  assert "skipping 1 of 2 points already in " + path in messages
  rows = _lines(path)
  assert [r["point"] for r in rows] == [AR_POINT, SPEC_POINT]
  assert rows[1]["autoregressive_tokens_per_second"] == rows[0]["tokens_per_second"]  # baseline from the file


def test_cli_skips_a_finished_table_and_rejects_unknown_fields(model_dirs, finished_table, tmp_path):
  table = str(tmp_path / "table.jsonl")
  shutil.copy(finished_table[0], table)
  base = [
      sys.executable, "-m", "experiments.sweep", "--config=configs/sweeps/tiny.py",
      f"--config.base.target={model_dirs[0]}", f"--config.base.draft={model_dirs[1]}", f"--config.output={table}"
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  ok = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True)
  assert ok.returncode == 0, ok.stderr[-3000:]
  assert "skipping 2 of 2 points" in ok.stdout and len(_lines(table)) == 2
  bad = subprocess.run(base + ["--config.axes.kk=(1,)"], cwd=ROOT, env=env, capture_output=True, text=True)
  assert bad.returncode != 0 and "kk" in bad.stderr


@pytest.mark.parametrize("main_spec, program", [(None, "experiments/sweep.py"),
                                                (sweep.__spec__, "-m experiments.sweep")])
def test_rows_name_the_command_and_paths_from_the_repository_root(monkeypatch, main_spec, program):
  """Run as a script or with -m (argv[0] is then absolute), with absolute paths: the row holds none of
  the repository's; paths outside it stay as given."""
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(sys.modules["__main__"], "__spec__", main_spec)
  outside = f"{ROOT}-elsewhere/prompts.jsonl"  # shares the root's prefix, not its directory
  monkeypatch.setattr(sys, "argv", [
      os.path.join(ROOT, "experiments", "sweep.py"), f"--config={ROOT}/configs/sweeps/tiny.py",
      f"--config.base.prompts_file={outside}", "--config.output",
      os.path.join(ROOT, "experiments", "results", "t.jsonl")
  ])
  spec = _sweep(["target", "draft"], "t.jsonl")
  point, cfg = sweep.grid(spec)[0]
  row = sweep.make_row(spec, point, cfg, {"tokens_per_second": 1.0}, None, [])
  assert row["command"] == (f"python {program} --config=configs/sweeps/tiny.py --config.base.prompts_file={outside} "
                            "--config.output experiments/results/t.jsonl")
  assert ROOT + os.sep not in json.dumps(row).replace(outside, "")


@pytest.mark.parametrize("axis, values, message", [
    ("kk", (1, 2), "sweep axis 'kk' is not a field of the base decode config"),
    ("k", 3, "sweep axis 'k' must be a non-empty tuple"),
    ("k", (1.5,), "sweep axis 'k': value 1.5"),
    ("k", (0, 1), "config.k"),
    ("ngram_min", (1, 2), "sweep axis 'ngram_min' is not a field .*did you mean 'ngram'"),
])
def test_bad_axes_fail_before_any_model_is_loaded(tmp_path, axis, values, message):
  cfg = _sweep([str(tmp_path / "no-target"), str(tmp_path / "no-draft")], str(tmp_path / "t.jsonl"))
  cfg.axes = ml_collections.ConfigDict({**cfg.axes.to_dict(), axis: values})  # any type, as a file may
  with pytest.raises(ValueError, match=message):
    sweep.run(cfg, log=lambda m: None)
  assert not os.path.exists(tmp_path / "t.jsonl")


def test_a_drafter_setting_is_an_axis_by_its_dotted_name(tmp_path):
  """`axes.ngram.min`: one speculative point per value, one autoregressive baseline for all, whose
  decode config keeps the base's value; a value the drafter refuses names its field."""
  cfg = _sweep([str(tmp_path / "target"), ""], str(tmp_path / "t.jsonl"))
  cfg.base.drafter = "ngram"
  cfg.axes.ngram = ml_collections.ConfigDict({"min": (1, 2)})
  points = sweep.grid(cfg)
  assert sorted(json.dumps(p, sort_keys=True) for p, _ in points) == sorted(
      json.dumps(p, sort_keys=True)
      for p in ({"k": None, "mode": "autoregressive", "ngram.min": None},
                *({"k": k, "mode": "speculative", "ngram.min": n} for k in cfg.axes.k for n in (1, 2))))
  for point, decode in points:
    assert decode.ngram.min == (point["ngram.min"] or cfg.base.ngram.min)
  cfg.axes.ngram.min = (0,)
  with pytest.raises(ValueError, match="config.ngram.min must be an integer >= 1"):
    sweep.grid(cfg)


def test_every_sweep_config_parses_into_a_valid_grid():
  sizes = {}
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "sweeps", "[!_]*.py"))):
    name = os.path.basename(path).removesuffix(".py")
    cfg = importlib.import_module(f"configs.sweeps.{name}").get_config()
    sizes[name] = len(sweep.grid(cfg))  # validates axis names and every point's decode config
  assert sizes == {
      "qwen_coder_batch": 8, "qwen_coder_k": 16, "qwen_coder_ngram_trees": 5, "qwen_coder_trees": 22,
      "qwen_coder_trees_speed": 14, "smollm2_distill": 14, "smollm2_eagle": 16, "tiny": 2
  }  # baselines counted once


def _fixture_rows() -> list[dict]:
  """A sweep table over draft x temperature x batch x K with its autoregressive baselines."""
  rows = []
  for batch in (1, 2):
    for temperature in (0.0, 1.0):
      rows.append({
          "point": {
              "batch_size": batch, "draft": None, "k": None, "mode": "autoregressive", "temperature": temperature
          }, "mode": "autoregressive", "k": None, "draft": None, "batch_size": batch, "temperature": temperature,
          "tokens_per_second": 5.0
      })
      for draft, alpha in (("drafts/plain", 0.6), ("drafts/distilled", 0.8)):
        for k in (1, 2, 3):
          point = {"batch_size": batch, "draft": draft, "k": k, "mode": "speculative", "temperature": temperature}
          rows.append({
              "point": point, **point, "acceptance_rate": alpha - 0.05 * k,
              "mean_accepted_length": metrics.expected_accepted_length(alpha, k),
              "per_position_acceptance": [alpha] * k, "speedup_vs_autoregressive": 1.0 + alpha / k,
              "theoretical_speedup": metrics.theoretical_speedup(alpha, k, 0.3)
          })
  return rows


def test_plots_render_every_figure(tmp_path):
  table = tmp_path / "table.jsonl"
  table.write_text("".join(json.dumps(row) + "\n" for row in _fixture_rows()))
  out = tmp_path / "plots"
  run = subprocess.run([
      sys.executable, "-m", "experiments.plots", "--config=configs/reports/plots.py", f"--config.table={table}",
      f"--config.output={out}", "--config.k=2", "--config.labels=('drafts/plain=before', 'drafts/distilled=after')"
  ], cwd=ROOT, capture_output=True, text=True)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "skipped" not in run.stdout
  names = ("acceptance_vs_k", "speedup_vs_k", "per_position_acceptance", "speedup_vs_batch", "distillation")
  for name in names:
    data = (out / f"{name}.png").read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000, name


def test_plots_skip_figures_whose_axes_are_missing(tmp_path):
  rows = [
      r for r in _fixture_rows() if r["mode"] == "speculative" and r["batch_size"] == 1 and r["temperature"] == 0.0 and
      r["draft"] == "drafts/plain"
  ]
  for row in rows:  # a K-only sweep without baseline or cost ratio
    row["point"] = {"k": row["k"]}
    row["speedup_vs_autoregressive"] = row["theoretical_speedup"] = None
  messages = []
  written = plots.plot_all(rows, str(tmp_path), log=messages.append)
  assert sorted(os.path.basename(p) for p in written) == ["acceptance_vs_k.png", "per_position_acceptance.png"]
  skipped = "\n".join(m for m in messages if m.startswith("skipped"))
  assert "speedup_vs_k: no speedups" in skipped
  assert "speedup_vs_batch: needs a 'batch_size' axis" in skipped
  assert "distillation: needs a 'draft' axis" in skipped


def test_report_prints_one_markdown_line_per_row():
  rows = _fixture_rows()
  for row in rows:
    row.update(command="python -m experiments.sweep", environment={"jax": "x"}, draft_vocab=0)
  text = report_sweep.markdown(rows).splitlines()
  assert len(text) == 5 + len(rows) and text[3].startswith("| mode | batch | K | drafter | draft | draft head |")
  spec = next(line for line in text if "| speculative | 2 | 3 | model | drafts/distilled | all | 1.0 |" in line)
  assert f"| {1.0 + 0.8 / 3:.2f} |" in spec  # the distilled draft's speedup at K = 3
