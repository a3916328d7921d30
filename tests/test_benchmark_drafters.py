"""`experiments.benchmark_drafters` end to end on tiny HF directories (its `tiny` config: every prompt set,
regime and drafter, and transformers plain and with prompt lookup, in one subprocess run), its plan and
config errors, and the standard-library prompt sets it decodes."""

import json
import os
import re
import subprocess
import sys

import pytest

from configs import code_edit_prompts
from configs.benchmarks import adaptive, drafters, other_tokenizer
from experiments import benchmark_drafters
from experiments.benchmark_drafters import AUTOREGRESSIVE, System
from specjax.errors import ConfigError
from tests.helpers.tiny_hf import make_hf_model, save_char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save_tiny(directory: str, seed: int) -> None:
  """A tiny qwen2 directory whose positions hold a whole code-edit prompt in characters (~1,300)."""
  model = make_hf_model("qwen2", seed)
  model.config.max_position_embeddings = 2048
  model.save_pretrained(directory)
  save_char_tokenizer(directory)


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory):
  """One run of the CLI on the tiny config: (results, stdout, output path)."""
  target, draft, second = (str(tmp_path_factory.mktemp(name)) for name in ("target", "draft", "second"))
  _save_tiny(target, seed=0)
  _save_tiny(draft, seed=1)  # another model: drafts are rejected too
  _save_tiny(second, seed=2)  # the draft of raw/sampled (other_drafts.second)
  output = str(tmp_path_factory.mktemp("results") / "drafters.json")
  command = [
      sys.executable, "-m", "experiments.benchmark_drafters", "--config=configs/benchmarks/drafters.py:tiny",
      f"--config.target={target}", f"--config.draft={draft}", f"--config.other_drafts.second={second}",
      f"--config.output={output}"
  ]
  done = subprocess.run(command, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(output) as f:
    return json.load(f), done.stdout, output


@pytest.mark.slow
def test_one_run_records_every_group_system_and_cost(benchmark):
  results, _, _ = benchmark
  assert results["command"].startswith("python -m experiments.benchmark_drafters --config=configs/benchmarks/")
  for field in ("jax", "transformers", "torch", "platform", "processor"):
    assert field in results["environment"], field
  systems = {}
  for row in results["runs"]:
    systems.setdefault(row["group"], []).append(row["system"])
  # The baseline first, after every ar_every = 2 systems, and last; "model" = K 2 (no threshold runs).
  assert systems == {
      "code_edit/greedy": [AUTOREGRESSIVE, "ngram_k3",
                           AUTOREGRESSIVE], "code_edit/batched": [AUTOREGRESSIVE, "ngram_k3", AUTOREGRESSIVE],
      "raw/greedy": [AUTOREGRESSIVE, "model_k2_t0.06_adaptive", "model+pair_adaptive",
                     AUTOREGRESSIVE], "raw/sampled": [AUTOREGRESSIVE, "model@second_k2", AUTOREGRESSIVE]
  }
  assert results["prompts"]["code_edit/greedy"] == code_edit_prompts.code_edit_prompts()[:2]
  assert len(results["prompts"]["code_edit/batched"]) == 2 and len(results["prompts"]["raw/greedy"]) == 2

  cost = results["costs"]
  # Verified draft tokens: K = 2 and 3 (chains), 4 (the tree (2, 1)).
  assert set(cost["verify_cost"]) == {"1", "2"} and set(cost["verify_cost"]["1"]) == {"2", "3", "4"}
  assert cost["cost_ratio_c"]["1"]["ngram"] == 0.0
  assert cost["cost_ratio_c"]["1"]["model"] > 0
  assert cost["cost_ratio_c"]["1"]["model@second"] > 0
  drafts = {row["system"]: row["draft_model"] for row in results["runs"] if row["drafter"] == "model"}
  assert os.path.basename(drafts["model_k2_t0.06_adaptive"]).startswith("draft")  # the draft each run loaded
  assert os.path.basename(drafts["model@second_k2"]).startswith("second")
  adaptive = next(row for row in results["runs"] if row["system"] == "model_k2_t0.06_adaptive")
  assert adaptive["k_policy"]["lengths"] == [0, 1, 2] and len(adaptive["k_policy"]["cost_table_s"]) == 3
  assert sum(adaptive["k_policy"]["rounds_per_length"]) > 0 and adaptive["modelled_speedup"] is None
  assert adaptive["policy_step_s"] > 0 and adaptive["policy_share_of_cheapest_round"] > 0
  tree = next(row for row in results["runs"] if row["system"] == "model+pair_adaptive")
  assert (tree["tree"], tree["k"], tree["k_policy"]["lengths"]) == ("(2, 1)", 2, [0, 1, 1, 2, 2])
  assert tree["k_policy"]["spine"] == [False, True, False, True, False]  # each depth's spine, then its cut
  assert sum(tree["k_policy"]["rounds_per_length"]) > 0 and tree["outputs_match_autoregressive"]
  for row in results["runs"]:
    assert row["tokens_per_second"] > 0 and row["compile_time_s"] > 0
    assert row["batch_size"] == (2 if row["regime"] == "batched" else 1)
    assert row["temperature"] == (1.0 if row["regime"] == "sampled" else 0.0)
    if row["system"] == AUTOREGRESSIVE:
      continue
    group = results["groups"][row["group"]]
    assert row["speedup_vs_autoregressive"] == pytest.approx(row["tokens_per_second"] /
                                                             group["autoregressive_tokens_per_second"])
    source = re.split(r"_k|\+", row["system"])[0]  # the drafter, with "@" and its draft's alias if it names one
    assert row["cost_ratio_c"] == cost["cost_ratio_c"][str(row["batch_size"])][source]
    verified = 4 if row["tree"] else row["k"]
    assert row["verify_cost"] == cost["verify_cost"][str(row["batch_size"])][str(verified)]
    if row["k_policy"]["kind"] == "adaptive":  # it may propose nothing (tiny random models agree rarely)
      continue
    assert row["alpha_hat"] is not None and 0 < row["mean_accepted_length"] <= row["k"] + 1
    assert row["modelled_speedup"] == pytest.approx(row["theoretical_speedup"] * (row["k"] * row["cost_ratio_c"] + 1) /
                                                    (row["k"] * row["cost_ratio_c"] + row["verify_cost"]))


@pytest.mark.slow
def test_greedy_outputs_equal_autoregressive_and_transformers(benchmark):
  results, _, _ = benchmark
  for key, group in results["groups"].items():
    assert group["autoregressive_outputs_agree"], key
    assert len(group["autoregressive_runs"]) >= 2
  for row in results["runs"]:
    if row["system"] != AUTOREGRESSIVE:
      assert row["outputs_match_autoregressive"] is (True if row["temperature"] == 0 else None), row["system"]
  plain, lookup, assisted = results["transformers"]
  assert ((plain["system"], lookup["system"],
           assisted["system"]) == ("transformers_generate", "transformers_prompt_lookup", "transformers_assisted"))
  assert lookup["generate_kwargs"] == {"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 2}
  assert assisted["generate_kwargs"] == {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "constant"}
  for row in (plain, lookup, assisted):
    assert row["group"] == "code_edit/greedy" and len(row["token_ids"]) == 2
    assert row["outputs_match_autoregressive"] is True and row["speedup_vs_autoregressive"] > 0


@pytest.mark.slow
def test_tables_are_printed_and_reprinted_from_the_file(benchmark):
  results, stdout, output = benchmark
  printed = benchmark_drafters.tables(results)
  assert printed in stdout
  for heading in ("#### code_edit, greedy: batch 1, temperature 0", "#### raw, sampled: batch 1, temperature 1",
                  "#### code_edit, batched: batch 2"):
    assert heading in printed
  assert "| ngram K=3 (n=1..2) |" in printed and "| model K<=2 adaptive, stop below 0.06 |" in printed
  assert "transformers prompt lookup / transformers generate:" in printed
  assert "differ from specjax autoregressive: none." in printed
  report = subprocess.run([
      sys.executable, "-m", "experiments.benchmark_drafters", "--config=configs/benchmarks/drafters.py:tiny",
      f"--config.report={output}"
  ], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
  assert report.returncode == 0 and report.stdout.strip() == printed.strip(), report.stderr[-2000:]


def test_systems_expand_and_baselines_interleave():
  cfg = drafters.get_config()
  assert benchmark_drafters.parse_systems(
      ("model", "ngram", "layer_skip_k6", "model_k5", "mine.mod:Lookup_k3", "mine.mod:Lookup", "model_k8_adaptive",
       "ngram_adaptive"), cfg, "x") == [
           System("model", 5),
           System("model", 8),
           System("model", 8, 0.3),
           System("model", 8, 0.5),
           System("model", 8, 0.7),
           System("ngram", 8),
           System("layer_skip", 6),
           System("mine.mod:Lookup", 3),
           System("mine.mod:Lookup", cfg.default_k),  # model_k5 once; a drafter of one's own by import path
           System("model", 8, 0.0, "adaptive"),
           System("ngram", 8, 0.0, "adaptive")
       ]
  assert [s.name for s in benchmark_drafters.parse_systems(("model_k8_adaptive", "ngram_adaptive"), cfg, "x")
         ] == ["model_k8_adaptive", "ngram_k8_adaptive"]
  cfg.other_drafts.small = "smollm2-135m-instruct"
  other = benchmark_drafters.parse_systems(("model@small_k3", "model@small_k8_t0.5_adaptive"), cfg, "x")
  assert other == [System("model", 3, draft="small"), System("model", 8, 0.5, "adaptive", "small")]
  assert [s.name for s in other] == ["model@small_k3", "model@small_k8_t0.5_adaptive"]
  assert benchmark_drafters.decode_config(cfg, other[0]).draft == "smollm2-135m-instruct"
  assert benchmark_drafters.decode_config(cfg, System("model", 3)).draft == cfg.draft
  cfg.draft_weights.small = "int4"  # that alias's weights quantized; the others as drafters.model.weights
  assert benchmark_drafters.decode_config(cfg, other[0]).model.weights == "int4"
  assert benchmark_drafters.decode_config(cfg, System("model", 3)).model.weights == ""
  cfg.draft_weights.nowhere = "int8"
  with pytest.raises(ConfigError, match="config.draft_weights.nowhere: no config.other_drafts.nowhere"):
    benchmark_drafters.parse_systems(("model_k3",), cfg, "x")
  del cfg.draft_weights["nowhere"]
  cfg.trees.spines = "(3, 1, 1)"
  trees = benchmark_drafters.parse_systems(("model+spines", "model@small+spines_adaptive"), cfg, "x")
  assert trees == [System("model", 3, tree="spines"), System("model", 3, 0.0, "adaptive", "small", "spines")]
  assert [s.name for s in trees] == ["model+spines", "model@small+spines_adaptive"]
  assert [s.verified(cfg) for s in trees] == [9, 9] and System("model", 3).verified(cfg) == 3
  tree_config = benchmark_drafters.decode_config(cfg, trees[1])
  assert (tree_config.tree, tree_config.k, tree_config.k_policy) == ("(3, 1, 1)", 3, "adaptive")
  assert benchmark_drafters.decode_config(cfg, System("model", 3)).tree == ""
  with pytest.raises(ConfigError, match="names 'other', which config.trees lacks"):
    benchmark_drafters.parse_systems(("model+other",), cfg, "x")
  group = benchmark_drafters.Group("raw", "greedy", 1, 0.0, False, ("p",), [System("model", k) for k in (1, 2, 3, 4)])
  assert [s.name for s in benchmark_drafters.run_order(group, 3)
         ] == [AUTOREGRESSIVE, "model_k1", "model_k2", "model_k3", AUTOREGRESSIVE, "model_k4", AUTOREGRESSIVE]
  group.systems = group.systems[:2]
  assert [s.name for s in benchmark_drafters.run_order(group, 1, repeats=2)] == [
      AUTOREGRESSIVE, "model_k1", AUTOREGRESSIVE, "model_k2", AUTOREGRESSIVE, "model_k1", AUTOREGRESSIVE, "model_k2",
      AUTOREGRESSIVE
  ]


def test_a_repeated_system_is_summarised_over_its_adjacent_baselines():
  """repeats = 2 of one system: each run's speedup over the baseline runs before and after it, and their
  mean, min and max (9 / 10 and 10.5 / 10.5 here: 0.95, 0.9, 1.0); a system run once has no summary."""
  speeds = [(AUTOREGRESSIVE, 10.0), ("a", 9.0), (AUTOREGRESSIVE, 10.0), ("a", 10.5), ("b", 7.0), (AUTOREGRESSIVE, 11.0)]
  runs = [{
      "group": "raw/greedy", "prompt_set": "raw", "regime": "greedy", "batch_size": 1, "temperature": 0.0,
      "system": name, "label": name, "tokens_per_second": speed, "token_ids": [[1]], "prompt_tokens": [3],
      "compile_time_s": 1.0
  } for name, speed in speeds]
  environment = {"jax": "", "flax": "", "transformers": "", "processor": "", "platform": "", "backend": "cpu"}
  results = {"command": "python -m experiments.benchmark_drafters", "environment": environment, "runs": runs}
  printed = benchmark_drafters.tables(results)
  assert results["groups"]["raw/greedy"]["repeated"] == {
      "a": {
          "runs": 2, "speedup_vs_adjacent_mean": pytest.approx(0.95), "speedup_vs_adjacent_min": pytest.approx(0.9),
          "speedup_vs_adjacent_max": pytest.approx(1.0)
      }
  }
  assert "a, 2 runs: speedup over the adjacent autoregressive runs 0.950 on average (0.900-1.000)." in printed


@pytest.mark.parametrize("module, variant, groups", [(adaptive, "", 9), (adaptive, "batch1", 4),
                                                     (adaptive, "batched", 5), (adaptive, "plain_ab", 1),
                                                     (adaptive, "trees", 3), (adaptive, "tree_widths", 3),
                                                     (adaptive, "sets", 3), (other_tokenizer, "", 5),
                                                     (other_tokenizer, "gemma", 5), (other_tokenizer, "compare", 6)])
def test_benchmark_configs_plan_their_groups(module, variant, groups):
  """The committed benchmark configs built on this one plan before loading anything (a system name or
  set that no longer parses fails here, not an hour into a run)."""
  assert len(benchmark_drafters.plan(module.get_config(variant), print)) == groups


def test_plan_skips_layer_skip_without_layers():
  cfg, messages = drafters.get_config(), []
  cfg.drafters.layer_skip.layers = ""
  groups = benchmark_drafters.plan(cfg, messages.append)
  assert [g.key for g in groups
         ] == ["code_edit/greedy", "code_edit/batched", "chat/greedy", "chat/sampled", "raw/greedy", "raw/sampled"]
  assert all(s.drafter != "layer_skip" for g in groups for s in g.systems)
  assert any("skipping layer_skip" in m for m in messages)
  batched = groups[1]
  assert (batched.batch_size, len(batched.prompts), batched.chat) == (4, 4, True)
  cfg.drafters.layer_skip.layers = "0-13"
  assert any(s.drafter == "layer_skip" for g in benchmark_drafters.plan(cfg, print) for s in g.systems)


@pytest.mark.parametrize("field, value, message", [
    ("sets.chat.greedy",
     ("model_k8_t1.5",), r"config.sets.chat.greedy, system model_k8_t1.5: .*config.model.stop_threshold"),
    ("sets.raw.sampled", ("ngram_t0.5",), r"config.sets.raw.sampled: unknown system 'ngram_t0.5'"),
    ("prompt_sets", ("code_edit", "prose"), r"unknown set 'prose'"),
    ("sets.chat.num_prompts", 9, r"config.sets.chat.greedy: 9 prompts needed .* the set has 8"),
    ("transformers_set", "chat", r"config.transformers_set 'chat' is not among"),
    ("draft", "", r"config.draft is empty"), ("repeats", 0, r"config.repeats must be an integer >= 1, got 0"),
    ("sets.raw.greedy", ("model@nowhere_k3",), r"config.sets.raw.greedy: system 'model@nowhere_k3' names "
     r"'nowhere', which config.other_drafts lacks \(it has: none\)"),
    ("other_drafts", {"small": "smollm2-135m-instruct"}, None)
])
def test_bad_configs_fail_before_loading(field, value, message):
  cfg = drafters.get_config()
  if field == "transformers_set":
    cfg.prompt_sets = ("raw",)
  *path, name = field.split(".")
  node = cfg
  for part in path:
    node = node[part]
  node[name] = value
  if field == "other_drafts":  # an alias on a drafter that loads no draft model
    cfg.sets.raw.greedy, message = ("ngram@small_k3",), (r"config.sets.raw.greedy, system ngram@small_k3: its "
                                                         r"drafter loads no draft model, so @small means nothing")
  with pytest.raises(ConfigError, match=message):
    benchmark_drafters.plan(cfg, print)


def test_prompt_sets_are_stdlib_sources_deterministically():
  edits, raw = code_edit_prompts.code_edit_prompts(), code_edit_prompts.continuation_prompts(8)
  assert edits == code_edit_prompts.code_edit_prompts() and len(edits) >= 8 and len(raw) >= 8
  for (name, instruction), prompt in zip(code_edit_prompts.CODE_EDITS, edits):
    source = code_edit_prompts.source(name)
    assert 15 <= len(source.splitlines()) <= 40, name
    assert prompt.startswith(instruction) and f"```python\n{source}```" in prompt  # the whole function
  for name, prompt in zip(code_edit_prompts.CONTINUATIONS, raw):
    source = code_edit_prompts.source(name)
    assert source.startswith(prompt) and len(prompt.splitlines()) == 8 < len(source.splitlines())
  with pytest.raises(ValueError, match="at least 1 line"):
    code_edit_prompts.continuation_prompts(0)
