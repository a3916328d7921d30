"""`specjax.Decoder` and the plug-in interface: the manual's own drafter (docs/writing-a-drafter.md),
written outside specjax, decodes through the command line and the Python API with the target's greedy
output; a Decoder loads once and generates with new sampling knobs without reloading or recompiling; bad
fields fail with one line."""

import json
import sys

import pytest

import specjax
from specjax import decode_spec, pipeline
from specjax.errors import ConfigError
from specjax.speculative import loop
from tests.helpers.cli import cli_config, decode_in_process
from tests.helpers.cli import model_dirs  # noqa: F401 (the fixture)
from tests.helpers.readme import python_block

PROMPTS = ("abcabcabcab", "def add(a, b): return a + b\ndef add(a, b): ret")  # repeats: LastMatch proposes


@pytest.fixture(scope="module")
def readme_drafter(tmp_path_factory):
  """The manual's example drafter as the module `my_drafters` in a directory of its own on sys.path."""
  source = python_block("class LastMatch(HistoryDrafter)")
  assert len(source.strip().splitlines()) <= 25  # "a drafter in one file", shown in full
  directory = tmp_path_factory.mktemp("plugin")
  (directory / "my_drafters.py").write_text(source)
  sys.path.insert(0, str(directory))
  yield "my_drafters:LastMatch"
  sys.path.remove(str(directory))
  sys.modules.pop("my_drafters", None)


def test_the_manuals_check_of_its_example_drafter_runs(readme_drafter, capsys):
  """docs/writing-a-drafter.md's `specjax.testing` example, run as written: LastMatch's greedy output is
  the tiny target's and its sampled first tokens pass the chi-square test."""
  exec(compile(python_block("testing.check_sampled("), "check_my_drafter.py", "exec"), {})
  assert "LastMatch is exact on the tiny target" in capsys.readouterr().out


def test_the_readme_drafter_keeps_the_targets_greedy_output_through_the_cli_and_the_decoder(
    model_dirs, readme_drafter, tmp_path):
  dec = specjax.Decoder(config=cli_config(model_dirs, drafter=readme_drafter, prompts=PROMPTS))
  assert dec.draft is None  # a history drafter loads no draft model
  out = dec.generate(PROMPTS)
  baseline = dec.generate(PROMPTS, mode="autoregressive")
  assert out.token_ids == baseline.token_ids and out.texts == baseline.texts
  assert out.stats["acceptance"]["proposed"] > 0 and out.stats["draft_calls"] == 0  # it did propose; no model ran

  instance = sys.modules["my_drafters"].LastMatch(vocab_size=dec.target.config.vocab_size)
  by_instance = specjax.Decoder(config=cli_config(model_dirs, prompts=PROMPTS), drafter=instance)
  assert by_instance.draft is None and by_instance.generate(PROMPTS).token_ids == baseline.token_ids

  output = tmp_path / "out.json"
  status, stderr = decode_in_process([
      "--config=configs/tiny.py", f"--config.target={model_dirs[0]}", f"--config.drafter={readme_drafter}",
      f"--config.output={output}", f"--config.prompts={PROMPTS!r}"
  ])
  assert status == 0, stderr
  assert [o["token_ids"] for o in json.load(open(output))["outputs"]] == baseline.token_ids


def test_a_decoder_loads_once_and_changes_sampling_without_reloading_or_recompiling(model_dirs, monkeypatch):
  loads = []
  original_load = pipeline.load_models
  monkeypatch.setattr(pipeline, "load_models", lambda *a, **k: loads.append(1) or original_load(*a, **k))
  dec = specjax.Decoder(config=cli_config(model_dirs))
  greedy = dec.generate(["def add(a, b):", "hello"], temperature=0.0)
  assert greedy.token_ids == dec.generate(["def add(a, b):", "hello"], mode="autoregressive").token_ids
  assert set(greedy.stats) >= {"tokens_per_second", "alpha_hat", "mean_accepted_length", "per_position_acceptance"}
  assert greedy.texts == [dec.target.tokenizer.decode(ids, skip_special_tokens=True) for ids in greedy.token_ids]

  first = dec.generate(["hello", "abc"], temperature=0.7, seed=1)
  compiled = loop._generate._cache_size()
  second = dec.generate(["abc", "x = 1"], temperature=1.0, seed=2, top_k=0)
  assert loop._generate._cache_size() == compiled  # other knobs, other prompts: the same program
  # ... which ran before: no warm-up call (a first sampled program had one)
  assert first.stats["compile_time_s"] > 0 and second.stats["compile_time_s"] == 0
  # Requests' own knobs are runtime values of that program too; its greedy row gives the greedy output.
  mixed = dec.generate([specjax.Request("hello", temperature=0.0),
                        specjax.Request("abc", temperature=1.3, top_k=0)], temperature=0.7)
  assert loop._generate._cache_size() == compiled and mixed.stats["compile_time_s"] == 0
  assert mixed.token_ids[0] == greedy.token_ids[1]  # "hello"
  # Each output records what its request set for itself (the call's temperature 0.7 is not a request's).
  assert [{name: o.get(name) for name in ("temperature", "top_k", "top_p")} for o in mixed.results["outputs"]
         ] == [{"temperature": 0.0, "top_k": None, "top_p": None}, {"temperature": 1.3, "top_k": 0, "top_p": None}]
  with pytest.raises(ConfigError, match=r"top_p of request 2 must be in \(0, 1\] \(1 disables it\), got 0"):
    dec.generate(["abc", specjax.Request("abc", top_p=0, source="request 2")])
  assert dec.generate(["def add(a, b):", "hello"], temperature=0.0).token_ids == greedy.token_ids
  # A request's own budget (a runtime value: the same program) cuts its greedy output, the other row's whole.
  short = dec.generate([specjax.Request("def add(a, b):", max_new_tokens=3), "hello"], temperature=0.0)
  assert short.token_ids == [greedy.token_ids[0][:3], greedy.token_ids[1]]
  assert loop._generate._cache_size() == compiled
  with pytest.raises(ConfigError, match=r"max_new_tokens of request 1 1000 exceeds config.max_new_tokens"):
    dec.generate([specjax.Request("abc", max_new_tokens=1000)])
  with pytest.raises(ConfigError, match=r"max_new_tokens of request 2 must be an integer >= 1"):
    dec.generate(["abc", specjax.Request("abc", max_new_tokens=0, source="request 2")])
  assert first.results["config"]["temperature"] == 0.7 and second.results["config"]["temperature"] == 1.0

  ngram = dec.generate(["abcabcabc"], drafter="ngram", ngram={"min": 1, "max": 2})  # another drafter, same target
  assert ngram.token_ids == dec.generate(["abcabcabc"], mode="autoregressive").token_ids
  assert ngram.results["config"]["ngram"] == {"min": 1, "max": 2}

  # The adaptive K policy: its cost table is measured once per program, then reused.
  adaptive = dec.generate(["def add(a, b):", "hello"], k_policy="adaptive")
  assert adaptive.token_ids == greedy.token_ids
  policy = adaptive.stats["k_policy"]
  assert policy["lengths"] == [0, 1, 2, 3] and len(policy["cost_table_s"]) == 4  # k = 3
  assert all(cost > 0 for cost in policy["cost_table_s"]) and policy["calibration_time_s"] > 0
  assert sum(policy["rounds_per_length"]) > 0
  # Its plain rounds skip the draft (the whole history may wait as its lag), a fixed policy's lags by one at most.
  assert adaptive.stats["draft_max_lag"] == "history" and greedy.stats["draft_max_lag"] == 1
  again = dec.generate(["abc", "x = 1"], k_policy="adaptive")
  assert again.stats["k_policy"]["calibration_time_s"] == 0
  assert again.stats["k_policy"]["cost_table_s"] == policy["cost_table_s"]
  assert greedy.stats["k_policy"] == {
      "kind": "fixed", "lengths": [3], "rounds_per_length": [greedy.stats["target_calls"] - 1]
  }
  assert len(loads) == 1  # every call above reused the models loaded once


def test_a_draft_accepted_at_every_position_keeps_bfloat16_greedy_output_through_the_decoder(model_dirs):
  """The target drafts for itself, in bfloat16 through the CPU kernel: every draft token is accepted (alpha
  1), so every position of every verify pass is held against the one-token steps that drafted it and
  against the autoregressive program's tokens. A pair that accepts nothing checks only each pass's first
  position, and would miss a kernel whose sums depend on the number of rows multiplied."""
  dec = specjax.Decoder(
      config=cli_config(model_dirs, draft=model_dirs[0], dtype="bfloat16", matmul="cpu_kernel", max_new_tokens=20))
  spec = dec.generate(list(PROMPTS))
  assert spec.stats["alpha_hat"] == 1.0 and spec.stats["per_position_acceptance"] == [1.0, 1.0, 1.0]  # K = 3
  assert spec.token_ids == dec.generate(list(PROMPTS), mode="autoregressive").token_ids


@pytest.mark.parametrize("fields, message", [
    (dict(dtype="bfloat16"), "config.dtype changes the loaded models"),
    (dict(ngram_mni=2), "unknown config field 'ngram_mni'"),
    (dict(ngram_min=2), "config.ngram_min is now config.ngram.min"),
    ({"ngram.mn": 2}, r"unknown config field 'ngram.mn' \(did you mean 'ngram.min'\?\)"), (dict(k="five"), "config.k"),
    (dict(drafter="ngram", ngram={"min": 0}), "config.ngram.min must be an integer >= 1"),
    (dict(k_policy="sometimes"), "config.k_policy must be one of"),
    ({"adaptive.prior": 1.5}, r"config.adaptive.prior must be in \(0, 1\)"),
    ({"adaptive.calibration_rounds": 0}, "config.adaptive.calibration_rounds must be an integer >= 1"),
    (dict(k_policy="adaptive", tree="dynamic(6,3,2)"), "config.k_policy 'adaptive' chooses chain lengths and static")
])
def test_bad_fields_fail_with_one_line_naming_them(model_dirs, fields, message):
  dec = specjax.Decoder(config=cli_config(model_dirs, drafter="ngram", draft=""))
  with pytest.raises(ConfigError, match=message):
    dec.generate(["hello"], **fields)


def test_old_flat_fields_name_their_new_place_on_the_command_line_and_in_config_files():
  status, stderr = decode_in_process(["--config=configs/tiny.py", "--config.draft_layers=0-1"])
  assert status == 2 and stderr.strip() == "error: config.draft_layers is now config.layer_skip.layers"
  cfg = cli_config(["target", "draft"])
  cfg.unlock()
  cfg.draft_stop_threshold = 0.5  # a config file written for the flat fields
  with pytest.raises(ConfigError, match=r"config.draft_stop_threshold is now config.model.stop_threshold"):
    decode_spec.from_config(cfg)
