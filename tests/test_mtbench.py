"""`experiments.mtbench` on tiny HF directories with a chat template (its `tiny` config and a small
questions file in MT-Bench's format): every group and system, both turns, per-category numbers, the
transformers peer, greedy equality, tables, the figure, and resuming a killed run."""

import json
import os

import pytest

from configs.benchmarks import mtbench as mtbench_config
from experiments import mtbench
from specjax import pipeline
from specjax.errors import ConfigError
from tests.helpers.cli import chat_model_dirs  # noqa: F401 (the fixture)

QUESTIONS = [{"question_id": 1, "category": "math", "turns": ["1+1=", "and 2+2?"]},
             {"question_id": 2, "category": "coding", "turns": ["def f(x):", "shorter"]},
             {"question_id": 3, "category": "coding", "turns": ["x = [1, 2", "go on"]}]


def _config(chat_model_dirs, tmp_path, **fields):
  questions = tmp_path / "questions.jsonl"
  questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
  cfg = mtbench_config.get_config("tiny")
  cfg.target, cfg.draft = chat_model_dirs
  cfg.questions, cfg.output, cfg.figure = str(questions), str(tmp_path / "out.json"), str(tmp_path / "fig.png")
  cfg.update(fields)
  return cfg


@pytest.fixture(scope="module")
def benchmark(chat_model_dirs, tmp_path_factory):
  cfg = _config(chat_model_dirs, tmp_path_factory.mktemp("mtbench"))
  return cfg, mtbench.run(cfg, log=lambda m: None)


def test_every_group_and_system_runs_both_turns(benchmark):
  cfg, results = benchmark
  keys = ["batch1/T0", "batch1/T1", "batch2/T0", "batch2/T1"]
  assert list(results["groups"]) == keys
  for key in keys:
    systems = [r["system"] for r in results["runs"] if r["group"] == key]
    expected = (["autoregressive", "model_k2", "ngram_k2", "autoregressive"]
                if key.startswith("batch1") else ["autoregressive", "ngram_k2", "autoregressive"])
    assert systems == expected
  for row in results["runs"]:
    assert row["question_ids"] == [1, 1, 2, 2, 3, 3] and row["turn_of_output"] == [1, 2] * 3
    assert [t["turn"] for t in row["turns"]] == [1, 2]
    assert sum(t["generated_tokens"] for t in row["turns"]) == row["generated_tokens"]
    assert sum(c["generated_tokens"] for c in row["categories"].values()) == row["generated_tokens"]
    if row["temperature"] == 0 and row["system"] != "autoregressive":
      assert row["outputs_match_autoregressive"] is True, row["system"]
    if row["batch_size"] == 1 and row["system"] != "autoregressive":
      assert all(c["speedup_vs_autoregressive"] > 0 and c["tau"] >= 1 for c in row["categories"].values())
    if row["batch_size"] == 2:  # batches mix categories: no per-category speed
      assert all(c["tokens_per_second"] is None for c in row["categories"].values())


def test_transformers_builds_its_own_turns_and_matches_greedy(benchmark):
  _, results = benchmark
  (row,) = results["transformers"]
  assert (row["system"], row["group"], row["turn_of_output"]) == ("transformers_generate", "batch1/T0", [1, 2] * 3)
  assert row["outputs_match_autoregressive"] is True  # its turn 2 prompts come from its own turn 1 answers


def test_categories_sum_their_outputs():
  outputs = [{
      "category": "a", "num_tokens": 4, "batch_wall_time_s": 2.0,
      "stats": {"rounds": 2, "accepted": 2, "rejections": 1}
  }, {
      "category": "a", "num_tokens": 2, "batch_wall_time_s": 1.0,
      "stats": {"rounds": 1, "accepted": 1, "rejections": 1}
  }, {
      "category": "b", "num_tokens": 3, "batch_wall_time_s": 3.0,
      "stats": {"rounds": 3, "accepted": 0, "rejections": 3}
  }]
  got = mtbench.by_category(outputs, per_question_time=True)
  assert got["a"]["tokens_per_second"] == 2.0 and got["a"]["tau"] == 2.0 and got["a"]["alpha_hat"] == 0.6
  assert got["b"]["tau"] == 1.0 and got["b"]["alpha_hat"] == 0.0


def test_tables_figure_and_report(benchmark):
  cfg, results = benchmark
  text = mtbench.tables(results)
  assert "Per category (batch1/T0)" in text and "| coding |" in text and "turn 2" in text
  assert "Greedy outputs that differ from specjax autoregressive: none." in text
  assert os.path.getsize(cfg.figure) > 10_000


def test_a_killed_run_resumes_with_what_is_missing(benchmark, monkeypatch):
  cfg, results = benchmark
  written = json.load(open(cfg.output))
  dropped = written["runs"].pop()  # as if killed before the last run was written
  with open(cfg.output, "w") as f:
    json.dump(written, f)
  calls = []
  real_run = pipeline.run
  monkeypatch.setattr(pipeline, "run", lambda *a, **k: calls.append(1) or real_run(*a, **k))
  resumed = mtbench.run(cfg, log=lambda m: None)
  assert len(calls) == 1 and resumed["runs"][-1]["system"] == dropped["system"]
  assert [r["index"] for r in resumed["runs"]] == [r["index"] for r in results["runs"]]


def test_a_smaller_grid_keeps_its_runs_and_another_budget_starts_afresh(benchmark):
  cfg, results = benchmark
  earlier = json.load(open(cfg.output))
  smaller = cfg.copy_and_resolve_references()
  smaller.temperatures = (0.0,)
  groups = mtbench.plan(smaller)
  kept = mtbench.reusable(earlier, mtbench._config_record(smaller), groups, smaller)
  assert {r["group"] for r in kept["runs"]} == {"batch1/T0", "batch2/T0"}
  assert len(kept["runs"]) == len([r for r in earlier["runs"] if r["temperature"] == 0])
  assert len(kept["transformers"]) == 1
  longer = cfg.copy_and_resolve_references()
  longer.max_new_tokens += 1
  assert mtbench.reusable(earlier, mtbench._config_record(longer), mtbench.plan(longer), longer) is None


@pytest.mark.parametrize("field, value, message", [
    ("questions_per_category", 0, "config.questions_per_category must be >= 1"),
    ("categories", ("poetry",), "config.categories: unknown MT-Bench category poetry"),
    ("systems", ("bogus",), "config.systems: unknown system 'bogus'"),
    ("transformers", ("beam",), "config.transformers: unknown system 'beam'"),
    ("transformers_temperatures", (0.5,), "config.transformers_temperatures"),
])
def test_bad_configs_fail_before_loading(field, value, message):
  cfg = mtbench_config.get_config()
  cfg[field] = value
  with pytest.raises(ConfigError, match=message):
    mtbench.plan(cfg)
