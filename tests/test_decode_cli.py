"""`python -m specjax.decode` end to end on tiny HF directories with a character tokenizer."""

import json
import os
import re

import jax
import numpy as np
import pytest

from specjax import decode, decode_spec, generation, pipeline, prompts, session
from specjax.decode_config import default_config
from specjax.errors import ConfigError
from specjax.speculative.k_policy import tuning
from specjax.speculative.trees import tree as tree_lib
from tests.helpers.cli import cli_config, decode_in_process, run_cli
from tests.helpers.cli import model_dirs  # noqa: F401 (the fixture)
from tests.helpers.tiny_hf import save_char_tokenizer, save_hf_model


def test_greedy_speculative_equals_autoregressive_through_the_pipeline(model_dirs, tmp_path):
  prompts_file = tmp_path / "prompts.jsonl"
  prompts_file.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "abc", "x = 1"]))
  output = str(tmp_path / "out.json")
  spec = pipeline.run(cli_config(model_dirs, prompts_file=str(prompts_file), output=output), log=lambda m: None)
  ar = pipeline.run(cli_config(model_dirs, prompts_file=str(prompts_file), mode="autoregressive"), log=lambda m: None)
  assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
  assert len(spec["outputs"]) == 3  # the padded row of the last batch is dropped
  written = json.load(open(output))
  for field in ("tokens_per_second", "wall_time_s", "compile_time_s", "acceptance_rate", "mean_accepted_length",
                "per_position_acceptance"):
    assert field in written["stats"]
  assert len(written["stats"]["per_position_acceptance"]) == 3
  assert written["outputs"][0]["text"] == spec["outputs"][0]["text"]
  assert all(o["num_tokens"] == len(o["token_ids"]) > 0 for o in written["outputs"])


def test_restricted_draft_vocabulary_keeps_greedy_output(model_dirs, tmp_path):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("def f(x):\n    return x + 1\n\nabc abc abc\n")
  cfg = cli_config(model_dirs, model=dict(vocab=12, vocab_corpus=str(corpus)))
  spec = pipeline.run(cfg, log=lambda m: None)
  ar = pipeline.run(cli_config(model_dirs, mode="autoregressive"), log=lambda m: None)
  assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
  assert 0.5 < spec["stats"]["draft_vocab_coverage"] <= 1.0
  with pytest.raises(ValueError, match=r"draft vocabulary size must be in \[1, 97\]"):
    pipeline.run(cli_config(model_dirs, model=dict(vocab=98, vocab_corpus=str(corpus))), log=lambda m: None)


@pytest.mark.parametrize("overrides, message", [(dict(k=0), "config.k"), (dict(mode="beam"), "config.mode"),
                                                (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"),
                                                (dict(max_new_tokens=0), "max_new_tokens"),
                                                (dict(prompts=(), prompts_file=""), "no prompts"),
                                                (dict(model=dict(vocab=-1)), "config.model.vocab")])
def test_bad_config_values_fail_early(model_dirs, overrides, message):
  cfg = cli_config(model_dirs, **overrides)
  with pytest.raises(ValueError, match=message):
    pipeline.run(cfg, log=lambda m: None)


@pytest.mark.parametrize("drafter, settings", [("ngram", dict(ngram=dict(min=1, max=2), k=4)),
                                               ("layer_skip", dict(layer_skip=dict(layers="0"))),
                                               ("model", dict(model=dict(stop_threshold=0.3), k=4))])
def test_every_drafter_keeps_greedy_output_through_the_pipeline(model_dirs, drafter, settings):
  """Each drafter chosen by the config field `drafter` gives the target's greedy output; n-gram and
  layer-skip need no draft model (an empty `draft`)."""
  draft = model_dirs[1] if drafter == "model" else ""
  spec = pipeline.run(cli_config([model_dirs[0], draft], drafter=drafter, **settings), log=lambda m: None)
  ar = pipeline.run(cli_config(model_dirs, mode="autoregressive"), log=lambda m: None)
  assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
  expected_calls = {
      "ngram": lambda calls: calls == 0, "layer_skip": lambda calls: calls > 0, "model": lambda calls: 0 < calls
  }[drafter]
  assert expected_calls(spec["stats"]["draft_calls"]), spec["stats"]["draft_calls"]
  if drafter == "layer_skip":
    assert spec["stats"]["draft_layers"] == [0]


@pytest.mark.parametrize("mode, drafter", [("autoregressive", "model"), ("speculative", "model"),
                                           ("speculative", "ngram"), ("speculative", "layer_skip")])
def test_a_session_reuses_its_caches_across_batches(model_dirs, mode, drafter):
  """Two batches through one session give the tokens that fresh sessions give, sampled at T = 0.8; the
  second call gets the caches the first returned (donated: the first call's key/value buffers, of the
  target and of a draft model, are gone; the n-gram history is rewritten by `init`, never read)."""
  cfg = cli_config(model_dirs, mode=mode, drafter=drafter, temperature=0.8, max_new_tokens=10)
  spec = decode_spec.from_config(cfg)
  target, draft = pipeline.load_models(spec, log=lambda m: None)
  built = session.build_drafter(spec, target, draft, log=lambda m: None) if mode == "speculative" else None
  ids = prompts.encode(target.tokenizer, ["def add(a, b):", "hello", "x = [1, 2", "ab"], chat=False)
  budget, keys = np.array([10, 7], np.int32), [jax.random.key(1), jax.random.key(2)]
  batches = [
      session.Batch(*generation.pad_prompts(rows, width=max(map(len, ids))), budget, real=2)
      for rows in (ids[:2], ids[2:])
  ]
  one = session.Session(spec, target, built, 64)
  reused, first_caches = [], None
  for batch, key in zip(batches, keys):
    out = one(batch, key)
    reused.append((np.asarray(out.tokens), np.asarray(out.counts)))
    first_caches = first_caches or [one.target_cache
                                   ] + ([one.draft_storage] if mode == "speculative" and drafter == "model" else [])
    if mode == "speculative":
      assert one.draft_storage is one.drafter.storage_of(out.draft_state)
  for cache in first_caches:
    assert cache.k.is_deleted() and cache.v.is_deleted()
  for batch, key, (tokens, counts) in zip(batches, keys, reused):
    fresh = session.Session(spec, target, built, 64)(batch, key)
    np.testing.assert_array_equal(tokens, fresh.tokens)
    np.testing.assert_array_equal(counts, fresh.counts)


@pytest.mark.parametrize("overrides, message", [
    (dict(drafter="medusa"), "unknown config.drafter 'medusa'; expected one of model, ngram, suffix, layer_skip"),
    (dict(drafter="no_such_module:Drafter"), "config.drafter 'no_such_module:Drafter': cannot import no_such_module"),
    (dict(drafter="specjax.sampling:SamplingParams"), "not a subclass of specjax.speculative.Drafter"),
    (dict(drafter="ngram", ngram=dict(min=0)), "config.ngram.min must be an integer >= 1, got 0"),
    (dict(drafter="ngram", ngram=dict(min=3, max=2)), r"config.ngram.max must be an integer >= min \(3\), got 2"),
    (dict(drafter="layer_skip", layer_skip=dict(layers="")), "config.layer_skip.layers '' selects no layer"),
    (dict(drafter="layer_skip", layer_skip=dict(layers="0-x")), "is not a layer index"),
    (dict(drafter="layer_skip", layer_skip=dict(layers="0-5")), r"config.layer_skip.layers '0-5' must lie in 0-1"),
    (dict(model=dict(stop_threshold=1.0)), r"config.model.stop_threshold must be in \[0, 1\)"),
    (dict(model=dict(stop_threshold=-0.1)), r"config.model.stop_threshold must be in \[0, 1\)"),
    (dict(drafter="model", draft=""), "config.draft is empty but config.drafter is 'model'")
])
def test_bad_drafter_settings_fail_before_the_models_load(model_dirs, tmp_path, overrides, message):
  """Every drafter setting is checked before a model loads (the target here does not exist), except the
  layer range, which needs the target's depth (checked right after it loads, before compiling)."""
  target = model_dirs[0] if overrides.get("layer_skip") == {"layers": "0-5"} else str(tmp_path / "no-model")
  with pytest.raises(ConfigError, match=message):
    pipeline.run(cli_config([target, model_dirs[1]], **overrides), log=lambda m: None)


@pytest.mark.parametrize("name", ["qwen_coder", "qwen_coder_ngram", "qwen_coder_layer_skip", "tiny"])
def test_every_decode_config_is_valid(name):
  """Each decode config in configs/ passes the checks that run before any model loads."""
  import importlib

  cfg = importlib.import_module(f"configs.{name}").get_config()
  assert set(cfg.keys()) == set(default_config().keys())  # extends the one default, adds nothing
  decode_spec.from_config(cfg)


def test_missing_model_and_a_draft_with_another_tokenizer(model_dirs, tmp_path):
  """A draft whose tokenizer swaps two ids drafts through the token-level intersection (every id pairs with
  the one of the same text): the greedy output is the target's own, and the log says so; with
  other_tokenizer "refuse" it stops before decoding."""
  with pytest.raises(FileNotFoundError, match="no such file"):
    pipeline.run(cli_config(model_dirs, target=str(tmp_path / "nope")), log=lambda m: None)
  other = tmp_path / "other"
  save_hf_model("qwen2", str(other), seed=2)
  save_char_tokenizer(str(other))
  table = json.load(open(other / "tokenizer.json"))
  table["model"]["vocab"]["a"], table["model"]["vocab"]["b"] = (table["model"]["vocab"]["b"],
                                                                table["model"]["vocab"]["a"])
  json.dump(table, open(other / "tokenizer.json", "w"))
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("a b ab ba xyz")
  logged = []
  spec = pipeline.run(cli_config(model_dirs, draft=str(other), model=dict(vocab_corpus=str(corpus))), log=logged.append)
  ar = pipeline.run(cli_config(model_dirs, mode="autoregressive"), log=lambda m: None)
  assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
  assert spec["stats"]["vocab_intersection"] == 97 and spec["stats"]["spelled_ids"] == 1
  assert any("token-level intersection of 97 ids" in line for line in logged)
  with pytest.raises(ValueError, match="different tokenizers.*other_tokenizer is 'refuse'"):
    pipeline.run(cli_config(model_dirs, draft=str(other), model=dict(other_tokenizer="refuse")), log=lambda m: None)


def test_cli_runs_without_log_noise(model_dirs):
  ok = run_cli([
      "--config=configs/tiny.py", f"--config.target={model_dirs[0]}", f"--config.draft={model_dirs[1]}",
      "--config.max_new_tokens=5", "--config.k=2"
  ])
  stdout, stderr = ok.communicate()
  assert ok.returncode == 0, stderr[-3000:]
  assert "acceptance rate" in stdout and "tokens / s" in stdout and re.search(r"\n  k policy +fixed, K = 2\n", stdout)
  assert stderr == ""  # no absl INFO line ("Unable to initialize backend 'tpu'") nor anything else


def test_the_printed_stats_say_what_the_adaptive_policy_chose_and_what_its_costs_are():
  policy = {
      "kind": "adaptive", "lengths": [0, 1, 3], "rounds_per_length": [7, 0, 2], "cost_table_s": [0.2, 0.85, 1.2501],
      "calibration_time_s": 54.14, "cost_table_measured_at": None
  }
  assert decode._policy_rows(policy) == [("k policy", "adaptive, K <= 3"), ("rounds per length", "0: 7  1: 0  3: 2"),
                                         ("round cost (ms)", "0: 200.0  1: 850.0  3: 1250.1  (measured in 54.1 s)")]
  stored = dict(policy, calibration_time_s=0.0, cost_table_measured_at="2026-12-04T14:11:18+00:00")
  assert decode._policy_rows(stored)[-1][1].endswith("(stored, measured at 2026-12-04T14:11:18+00:00)")
  assert decode._policy_rows({"kind": "fixed", "lengths": [5],
                              "rounds_per_length": [49]}) == [("k policy", "fixed, K = 5")]
  tree = dict(policy, lengths=[0, 2, 2], spine=[False, True, False])  # a tree's spine and its whole cut
  assert decode._policy_rows(tree)[1] == ("rounds per length", "0: 7  2 spine: 0  2: 2")


def _bad_inputs(tmp_path):
  """(command-line arguments after the tiny config and models, exit status, message regex) per bad input."""
  files = {
      "invalid.jsonl": '{"prompt": "a"}\n\n{"prompt": "b"\n', "string.jsonl": '"just a string"\n',
      "number.jsonl": '{"prompt": "a"}\n{"prompt": 3}\n', "no_field.jsonl": '{"text": "a"}\n',
      "turns.jsonl": '{"turns": ["a", 3]}\n', "two_turns.jsonl": '{"turns": ["a", "b"]}\n', "empty.txt": "\n\n"
  }
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  prompts = lambda name: f"--config.prompts_file={tmp_path / name}"
  return [
      (["--config.kk=2"], 2, r"unknown config field 'kk' \(did you mean 'k'\?\); known fields: adaptive, attention, "
       r"attention_block, "),
      (["--config.k=0"], 2, r"config.k \(draft tokens per round\) must be an integer >= 1, got 0"),
      (["--config.k=abc"], 2, r"flag --config.k=abc: invalid literal"),
      (["--config.temperature=-0.5"], 2, r"config.temperature must be >= 0"),
      (["--config.top_p=0"], 2, r"config.top_p must be in \(0, 1\]"),
      (["--config.mode=beam"], 2, r"config.mode must be one of"),
      (["--config.attention=flash"], 2, r"config.attention must be one of \('auto', 'dense', 'blockwise', 'kernel'\), "
       r"got 'flash'"),
      (["--config.attention=kernel", "--config.lower_only=tpu"], 2, r"config.attention='kernel' is the Pallas GPU "
       r"kernel: tpu has none here \(use blockwise\)"),
      (["--config.narrow_passes=maybe"], 2, r"config.narrow_passes must be one of \('auto', 'on', 'off'\)"),
      (["--config.lower_only=gpu"], 2, r"config.lower_only must be one of \('cpu', 'cuda', 'rocm', 'tpu'\)"),
      (["--config.prompts=3"], 2, r"config.prompts\[0\] must be a string, got int 3"),
      (["unexpected"], 2, r"unexpected arguments \['unexpected'\]"),
      ([prompts("missing.txt")], 1, r"prompts file .*missing.txt: No such file or directory"),
      ([prompts("empty.txt")], 1, r"prompts file .*empty.txt holds no prompt"),
      ([prompts("invalid.jsonl")], 1, r"invalid.jsonl:3: invalid JSON \(Expecting ',' delimiter"),
      ([prompts("string.jsonl")], 1, r"string.jsonl:1: expected a JSON object with a 'prompt' string or a 'turns' "
       r"list of strings, got a str"),
      ([prompts("number.jsonl")], 1, r"number.jsonl:2: .* got a 'prompt' of type int"),
      ([prompts("no_field.jsonl")], 1, r"no_field.jsonl:1: .* got neither a 'prompt' nor a 'turns' field"),
      ([prompts("turns.jsonl")], 1, r"turns.jsonl:1: .* got a 'turns' that is not a non-empty list of strings"),
      ([prompts("two_turns.jsonl"), "--config.chat=False"], 1, r"config.prompts_file .*two_turns.jsonl: "
       r"conversations of 2 turns need config.chat"),
      (["--config.prompts_file=mt-bench?category=poetry"], 1, r"config.prompts_file 'mt-bench\?category=poetry': "
       r"unknown MT-Bench category poetry; known: writing, roleplay, "),
      (["--config.prompts_file=mt-bench?per_category=2&turn=1"], 1, r"config.prompts_file .*: unknown option 'turn'"),
      ([f"--config.output={tmp_path / 'missing' / 'out.json'}"], 1, r"config.output .*out.json: directory .* "
       r"does not exist"),
      ([f"--config.output={tmp_path}"], 1, r"config.output .* is a directory"),
      ([f"--config.target={tmp_path / 'no-model'}"], 1, r"no-model: no such file or directory, and not a "
       r"registry model"),
  ]


def test_cli_reports_each_bad_input_in_one_line(model_dirs, tmp_path):
  """Every user error: one `error: ...` line on stderr naming the field or file, exit status 2 (config)
  or 1 (files, models), no traceback. Each case runs the CLI's entry point in this process
  (`decode_in_process`: the same parsing, checks and error path); one case of each exit status also runs
  in its own interpreter, so that the real exit status and stderr of the process stay checked."""
  cases = _bad_inputs(tmp_path)
  base = ["--config=configs/tiny.py", f"--config.target={model_dirs[0]}", f"--config.draft={model_dirs[1]}"]
  in_processes = {1: None, 2: None}  # exit status -> (case, the process running it)
  for arguments, status, message in cases:
    in_processes[status] = in_processes[status] or ((arguments, status, message), run_cli(base + arguments))
  for arguments, status, message in cases:
    got_status, stderr = decode_in_process(base + arguments)
    lines = stderr.strip().splitlines()
    assert (got_status, len(lines)) == (status, 1), (arguments, stderr[-2000:])
    assert re.fullmatch(f"error: .*{message}.*", lines[0]), (arguments, lines[0])
    assert "Traceback" not in stderr
  for (arguments, status, message), process in in_processes.values():
    stdout, stderr = process.communicate()
    lines = stderr.strip().splitlines()
    assert (process.returncode, len(lines)) == (status, 1), (arguments, stderr[-2000:])
    assert re.fullmatch(f"error: .*{message}.*", lines[0]), (arguments, lines[0])
    assert "Traceback" not in stdout + stderr


def test_cli_debug_switch_shows_the_traceback(model_dirs, monkeypatch):
  """With SPECJAX_DEBUG=1 the CLI's entry point re-raises the user error (the interpreter then prints its
  traceback) instead of exiting with one line; run in this process (`decode_in_process`: the entry point a
  new interpreter runs, without the ~2 s of starting one), where the error reaches the caller."""
  monkeypatch.setenv("SPECJAX_DEBUG", "1")
  with pytest.raises(ConfigError, match="config.k"):  # not the one-line exit (SystemExit)
    decode_in_process(["--config=configs/tiny.py", f"--config.target={model_dirs[0]}", "--config.k=0"])


def test_prompts_and_output_are_checked_before_any_model_loads(model_dirs, tmp_path):
  """With a target that does not exist, the error is still the prompts file's or the output's: they are
  checked first (a real pair takes up to ~130 s to load)."""
  missing_model = str(tmp_path / "no-model")
  with pytest.raises(ValueError, match="prompts file .*nope.txt"):
    pipeline.run(cli_config([missing_model] * 2, prompts_file=str(tmp_path / "nope.txt")), log=lambda m: None)
  with pytest.raises(ValueError, match="config.output .* does not exist"):
    pipeline.run(cli_config([missing_model] * 2, output=str(tmp_path / "no" / "out.json")), log=lambda m: None)


def test_results_go_to_a_fallback_file_when_the_output_vanishes(model_dirs, tmp_path, capsys):
  """The output directory is removed while decoding: the texts are still printed, the results land in a
  fallback file named in the error line, and the exit status is 1."""
  out_dir = tmp_path / "out"
  out_dir.mkdir()
  output = str(out_dir / "results.json")

  def remove_output_dir(message):
    if message.startswith("compiling") and out_dir.exists():
      out_dir.rmdir()

  cfg = cli_config(model_dirs, output=output)
  results = pipeline.run(cfg, log=remove_output_dir)
  fallback = results["written_to"]
  assert fallback and fallback != output and not os.path.exists(output)
  with open(fallback) as f:
    assert [o["text"] for o in json.load(f)["outputs"]] == [o["text"] for o in results["outputs"]]
  os.remove(fallback)

  out_dir.mkdir()
  original_run = pipeline.run
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(pipeline, "run",
                  lambda c, log, **reuse: original_run(c, log=lambda m: remove_output_dir(m) or log(m), **reuse))
    with pytest.raises(SystemExit) as exit_info:
      decode.main(cfg)
  captured = capsys.readouterr()
  assert exit_info.value.code == 1
  assert all(o["text"] in captured.out for o in results["outputs"])  # the texts were printed
  error = captured.err.strip().splitlines()[-1]
  assert re.fullmatch(
      r"error: could not write the results to config.output .*results.json; they were written "
      r"to (\S+) instead", error)
  os.remove(error.split(" to ")[-1].removesuffix(" instead"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_every_drafter_keeps_greedy_output_for_the_2026_families(family, tmp_path):
  """Qwen3 (QK-norm, explicit head_dim) and Gemma 3 (its block, sliding and global layers with their
  RoPE bases) pairs of tiny random checkpoints through the pipeline: the model, n-gram and layer-skip
  drafters each give the target's greedy output. (Llama-3.x and Gemma 2 differ from these only inside
  the model, whose logits and greedy continuations `tests/test_hf_parity.py` checks against
  transformers; every drafter drives a model through the same forward.)"""
  dirs = []
  for name, seed in (("target", 0), ("draft", 1)):
    directory = str(tmp_path / name)
    save_hf_model(family, directory, seed=seed)
    save_char_tokenizer(directory)
    dirs.append(directory)
  ar = pipeline.run(cli_config(dirs, mode="autoregressive"), log=lambda m: None)
  for drafter, draft in (("model", dirs[1]), ("ngram", ""), ("layer_skip", "")):
    spec = pipeline.run(cli_config([dirs[0], draft], drafter=drafter), log=lambda m: None)
    assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in ar["outputs"]], drafter


@pytest.mark.parametrize("tree, drafter", [("(2,2)", "model"), ("[[0], [1], [0, 0]]", "model"),
                                           ("dynamic(4, 2, 2)", "model"), ("(2, 1)", "ngram")])
def test_tree_drafter_keeps_greedy_output_through_the_pipeline(model_dirs, tree, drafter):
  """`config.tree` makes the model drafter draft that tree (k is its depth); greedy output is the
  target's, and the stats say how many nodes each round verified."""
  spec = pipeline.run(cli_config(model_dirs, tree=tree, k=7, drafter=drafter), log=lambda m: None)
  ar = pipeline.run(cli_config(model_dirs, mode="autoregressive"), log=lambda m: None)
  assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
  assert spec["stats"]["nodes_verified_per_round"] == {
      "(2,2)": 7, "[[0], [1], [0, 0]]": 4, "dynamic(4, 2, 2)": 5, "(2, 1)": 5
  }[tree]
  assert len(spec["stats"]["per_position_acceptance"]) == 2


def test_an_adaptive_tree_counts_the_nodes_of_the_cut_each_round_verified():
  """(2, 2): its cuts at depths 0, 1 and 2 hold 1, 3 and 7 nodes with the root, its spines of depth 1 and
  2 hold 2 and 3; three plain rounds, two of the spine of depth 2 and one of the cut of depth 2 verified
  (3 * 1 + 2 * 3 + 7) / 6 nodes a round; the fixed policy verifies all 7."""
  tree, dynamic = tree_lib.parse("(2, 2)"), tree_lib.parse("dynamic(4, 2, 2)")
  adaptive = {
      "lengths": [0, 1, 1, 2, 2], "spine": [False, True, False, True, False], "rounds_per_length": [3, 0, 0, 2, 1]
  }
  assert tuning.nodes_verified_per_round(tree, 6, adaptive) == pytest.approx(16 / 6)
  assert tuning.nodes_verified_per_round(tree, 6, {"lengths": [2], "rounds_per_length": [9]}) == 7
  assert tuning.nodes_verified_per_round(dynamic, 4, {"lengths": [2], "rounds_per_length": [9]}) == 5


@pytest.mark.parametrize("overrides, message",
                         [(dict(tree="(2,"), "config.tree .* neither"),
                          (dict(tree="[[0], [0, 1]]"), "config.tree: path \\[0, 1\\]"),
                          (dict(tree="()"), "config.tree: the branching tuple is empty"),
                          (dict(tree="(2,)", drafter="layer_skip",
                                layer_skip=dict(layers="0")), "config.drafter 'layer_skip' drafts no trees"),
                          (dict(tree="(2, 2)", drafter="ngram"), r"spines, \(b, 1, ..., 1\)"),
                          (dict(tree="dynamic(4, 2, 2)", drafter="ngram"), "spines"),
                          (dict(tree="dynamic(4, 2)"), r"config.tree .*dynamic\(N, D, b\)"),
                          (dict(tree="(2,)", model=dict(stop_threshold=0.3)), "exclude each other"),
                          (dict(tree_children="sorted"), "config.tree_children")])
def test_bad_tree_configs_fail_early(model_dirs, overrides, message):
  with pytest.raises(ConfigError, match=message):
    pipeline.run(cli_config(model_dirs, **overrides), log=lambda m: None)
