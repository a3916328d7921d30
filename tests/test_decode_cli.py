"""`python -m specjax.decode` end to end on tiny HF directories with a character tokenizer."""

import json
import os
import subprocess
import sys

import ml_collections
import pytest

from configs import tiny
from specjax import pipeline
from tests.tiny_hf import save_char_tokenizer, save_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
  dirs = []
  for name, seed in (("target", 0), ("draft", 1)):
    directory = str(tmp_path_factory.mktemp(name))
    save_hf_model("qwen2", directory, seed=seed)
    save_char_tokenizer(directory)
    dirs.append(directory)
  return dirs


def _config(model_dirs, **overrides) -> ml_collections.ConfigDict:
  cfg = tiny.get_config()
  cfg.target, cfg.draft = model_dirs
  cfg.update(overrides)
  return cfg


def test_greedy_speculative_equals_autoregressive_through_the_pipeline(model_dirs, tmp_path):
  prompts_file = tmp_path / "prompts.jsonl"
  prompts_file.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "abc", "x = 1"]))
  output = str(tmp_path / "out.json")
  spec = pipeline.run(_config(model_dirs, prompts_file=str(prompts_file), output=output), log=lambda m: None)
  ar = pipeline.run(_config(model_dirs, prompts_file=str(prompts_file), mode="autoregressive"),
                    log=lambda m: None)
  assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
  assert len(spec["outputs"]) == 3  # the padded row of the last batch is dropped
  written = json.load(open(output))
  for field in ("tokens_per_second", "wall_time_s", "compile_time_s", "acceptance_rate",
                "mean_accepted_length", "per_position_acceptance"):
    assert field in written["stats"]
  assert len(written["stats"]["per_position_acceptance"]) == 3
  assert written["outputs"][0]["text"] == spec["outputs"][0]["text"]
  assert all(o["num_tokens"] == len(o["token_ids"]) > 0 for o in written["outputs"])


def test_restricted_draft_vocabulary_keeps_greedy_output(model_dirs, tmp_path):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("def f(x):\n    return x + 1\n\nabc abc abc\n")
  cfg = _config(model_dirs, draft_vocab=12, draft_vocab_corpus=str(corpus))
  spec = pipeline.run(cfg, log=lambda m: None)
  ar = pipeline.run(_config(model_dirs, mode="autoregressive"), log=lambda m: None)
  assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
  assert 0.5 < spec["stats"]["draft_vocab_coverage"] <= 1.0
  with pytest.raises(ValueError, match=r"draft vocabulary size must be in \[1, 97\]"):
    pipeline.run(_config(model_dirs, draft_vocab=98, draft_vocab_corpus=str(corpus)), log=lambda m: None)


@pytest.mark.parametrize("overrides, message", [
    (dict(k=0), "config.k"), (dict(mode="beam"), "config.mode"), (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=(), prompts_file=""), "no prompts"), (dict(draft_vocab=-1), "config.draft_vocab")])
def test_bad_config_values_fail_early(model_dirs, overrides, message):
  cfg = _config(model_dirs, **overrides)
  with pytest.raises(ValueError, match=message):
    pipeline.run(cfg, log=lambda m: None)


def test_missing_model_and_different_tokenizers(model_dirs, tmp_path):
  with pytest.raises(FileNotFoundError, match="no such file"):
    pipeline.run(_config(model_dirs, target=str(tmp_path / "nope")), log=lambda m: None)
  other = tmp_path / "other"
  save_hf_model("qwen2", str(other), seed=2)
  save_char_tokenizer(str(other))
  table = json.load(open(other / "tokenizer.json"))
  table["model"]["vocab"]["a"], table["model"]["vocab"]["b"] = (table["model"]["vocab"]["b"],
                                                                table["model"]["vocab"]["a"])
  json.dump(table, open(other / "tokenizer.json", "w"))
  with pytest.raises(ValueError, match="different tokenizers"):
    pipeline.run(_config(model_dirs, draft=str(other)), log=lambda m: None)


def test_cli_runs_and_rejects_unknown_keys(model_dirs, tmp_path):
  base = [sys.executable, "-m", "specjax.decode", "--config=configs/tiny.py",
          f"--config.target={model_dirs[0]}", f"--config.draft={model_dirs[1]}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  ok = subprocess.run(base + ["--config.max_new_tokens=5", "--config.k=2"], cwd=ROOT, env=env,
                      capture_output=True, text=True)
  assert ok.returncode == 0, ok.stderr[-3000:]
  assert "acceptance rate" in ok.stdout and "tokens / s" in ok.stdout
  bad = subprocess.run(base + ["--config.kk=2"], cwd=ROOT, env=env, capture_output=True, text=True)
  assert bad.returncode != 0 and "kk" in bad.stderr
