"""Hub names (`org/name[@revision]`) resolved from a pre-populated Hugging Face cache, with no network.

The cache is laid out as huggingface_hub and `transformers` write it: `hub/models--org--tiny/` with
`snapshots/<commit>/` folders (tiny qwen2 models and the character tokenizer) and `refs/<branch or
tag>` files naming a commit. huggingface_hub reads HF_HOME and HF_HUB_OFFLINE once, at import (which
`transformers` did before any test runs), so the in-process tests point its `constants` at the
temporary cache and turn offline mode on; the command-line test sets the real environment variables of
a fresh process instead, as a user would.
"""

import os
import re

import numpy as np
import pytest
from huggingface_hub import constants

from specjax.models import hub
from specjax.models.load import load_model
from tests.helpers.cli import run_cli
from tests.helpers.tiny_hf import save_char_tokenizer, save_hf_model

MAIN, OTHER = "a" * 40, "b" * 40  # commit hashes of the two snapshots (seeds 0 and 2)
SEEDS = {MAIN: 0, OTHER: 2}


def _snapshot_dir(hub_cache, commit):
  return hub_cache / "models--org--tiny" / "snapshots" / commit


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
  """HF_HOME with `org/tiny`: refs/main -> MAIN, refs/v1 (a tag) -> OTHER."""
  home = tmp_path_factory.mktemp("hf_home")
  repo = home / "hub" / "models--org--tiny"
  for commit, seed in SEEDS.items():
    save_hf_model("qwen2", str(_snapshot_dir(home / "hub", commit)), seed=seed)
    save_char_tokenizer(str(_snapshot_dir(home / "hub", commit)))
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(MAIN)
  (repo / "refs" / "v1").write_text(OTHER)
  return home


@pytest.fixture
def offline_cache(hf_home, monkeypatch):
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  return hf_home / "hub"


def _embedding(model):
  return np.asarray(model.params["embed"]["embedding"])


@pytest.mark.parametrize("name, expected", [("Qwen/Qwen3-8B", ("Qwen/Qwen3-8B", None)),
                                            ("org/tiny@v1", ("org/tiny", "v1")),
                                            (f"org/tiny@{OTHER}", ("org/tiny", OTHER)),
                                            ("org/tiny@refs/pr/1", ("org/tiny", "refs/pr/1")),
                                            ("qwen2.5-coder-1.5b-instruct", None), ("/abs/dir", None),
                                            ("./org/tiny", None), ("a/b/c", None), ("model.gguf", None),
                                            ("org/", None)])
def test_parse_recognises_hub_names_only(name, expected):
  assert hub.parse(name) == expected


def test_a_hub_name_loads_its_main_snapshot_from_the_cache(offline_cache):
  model = load_model("org/tiny")
  from_dir = load_model(str(_snapshot_dir(offline_cache, MAIN)))
  assert model.name == "org/tiny" and model.config == from_dir.config
  np.testing.assert_array_equal(_embedding(model), _embedding(from_dir))
  assert model.tokenizer.fingerprint() == from_dir.tokenizer.fingerprint()


@pytest.mark.parametrize("revision", ["v1", OTHER])
def test_a_revision_picks_its_snapshot(offline_cache, revision):
  """A tag (refs/v1) or a commit hash selects the other snapshot, whose weights differ from main's."""
  model = load_model(f"org/tiny@{revision}")
  np.testing.assert_array_equal(_embedding(model), _embedding(load_model(str(_snapshot_dir(offline_cache, OTHER)))))
  assert not np.array_equal(_embedding(model), _embedding(load_model("org/tiny")))


@pytest.mark.parametrize("name", ["org/absent", "org/tiny@v2"])
def test_an_absent_hub_model_is_a_clear_error_offline(offline_cache, name):
  with pytest.raises(FileNotFoundError) as error:
    load_model(name)
  message = str(error.value)
  assert "\n" not in message and error.value.__cause__ is None and error.value.__suppress_context__
  assert re.fullmatch(
      f"{re.escape(name)}: no such file or directory, not a registry model, and as a hub "
      f"model not in the Hugging Face cache {re.escape(str(offline_cache))} and HF_HUB_OFFLINE "
      r"is set: download it where the hub is reachable \(`hf download org/\w+`\) or unset "
      "HF_HUB_OFFLINE", message), message


def test_only_config_tokenizer_and_safetensors_files_are_wanted(offline_cache, tmp_path, monkeypatch):
  """With the repository's file listing cached (as a download leaves it) naming PyTorch, ONNX and GGUF
  copies the snapshot lacks, the snapshot is still complete for specjax: those files are not among
  `HUB_FILES` (every file the snapshot holds is). A pattern list that wanted them would fail here."""
  tree_cache = pytest.importorskip("huggingface_hub._tree_cache")  # where huggingface_hub 2.x keeps listings
  repo = tmp_path / "hub" / "models--org--listed"
  snapshot = repo / "snapshots" / MAIN
  save_hf_model("qwen2", str(snapshot), seed=0)
  save_char_tokenizer(str(snapshot))
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(MAIN)
  files = sorted(os.listdir(snapshot)) + ["pytorch_model.bin", "onnx/model.onnx", "model-q4.gguf"]
  tree_cache.write_tree_cache(str(repo), MAIN, {f: tree_cache.TreeCacheEntry(size=1, blob_id="0" * 40) for f in files})
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
  assert hub.snapshot("org/listed") == str(snapshot)
  with pytest.raises(Exception, match="incomplete"):  # the same listing without the filter
    hub.huggingface_hub.snapshot_download("org/listed")


def test_a_local_directory_wins_over_a_hub_name(offline_cache, tmp_path, monkeypatch):
  """`org/tiny` relative to the working directory, when it exists there, is that directory."""
  save_hf_model("qwen2", str(tmp_path / "org" / "tiny"), seed=5)
  save_char_tokenizer(str(tmp_path / "org" / "tiny"))
  monkeypatch.chdir(tmp_path)
  model = load_model("org/tiny")
  assert model.name == "tiny"
  np.testing.assert_array_equal(_embedding(model), _embedding(load_model(str(tmp_path / "org" / "tiny"))))


@pytest.mark.slow
def test_cli_resolves_hub_names_through_hf_home_offline(hf_home):
  """`python -m specjax.decode` with HF_HOME and HF_HUB_OFFLINE=1 in its environment: a target and a
  draft named on the hub decode; an absent one ends with one `error:` line, exit status 1."""
  env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": None}  # the cache is $HF_HOME/hub
  base = ["--config=configs/tiny.py", "--config.max_new_tokens=4", "--config.k=2"]
  ok = run_cli(base + ["--config.target=org/tiny", "--config.draft=org/tiny@v1"], env=env)
  absent = run_cli(base + ["--config.target=org/absent", "--config.draft=org/tiny"], env=env)
  stdout, stderr = ok.communicate()
  assert ok.returncode == 0, stderr[-3000:]
  assert "acceptance rate" in stdout
  stdout, stderr = absent.communicate()
  lines = stderr.strip().splitlines()
  assert (absent.returncode, len(lines)) == (1, 1), stderr[-3000:]
  assert lines[0].startswith("error: org/absent: no such file or directory, not a registry model, and as a hub "
                             f"model not in the Hugging Face cache {hf_home / 'hub'} and HF_HUB_OFFLINE is set")
  assert "Traceback" not in stdout + stderr
