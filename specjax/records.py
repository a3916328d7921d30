"""What every result file records besides its numbers: the machine and library versions, and the command
that made it, with paths relative to the repository root so records name no machine's directories."""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable

import jax


def environment() -> dict[str, Any]:
  """Machine and versions, recorded with every result."""
  import flax
  import transformers

  return {
      "jax": jax.__version__, "flax": flax.__version__, "transformers": transformers.__version__,
      "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()], "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(), "python": platform.python_version()
  }


def relative(path: str) -> str:
  """`path` relative to the working directory (the repository root, where commands run) when it lies
  under it, so that records name no machine's directories; anything else as given."""
  cwd = os.getcwd()
  if os.path.isabs(path) and os.path.commonpath([path, cwd]) == cwd:
    return os.path.relpath(path, cwd)
  return path


def command() -> str:
  """This process's command line as run from the working directory, recorded with results:
  `python -m MODULE ARGS` or `python SCRIPT ARGS`, with the paths under the working directory relative."""
  spec = sys.modules["__main__"].__spec__
  program = ["-m", spec.name.removesuffix(".__main__")] if spec else [sys.argv[0]]
  return " ".join(["python", *(_relative_arg(arg) for arg in [*program, *sys.argv[1:]])])


def _relative_arg(arg: str) -> str:
  """One argument, a path or `--flag=path`, with `relative` applied to the path."""
  name, equals, value = arg.partition("=")
  return name + equals + relative(value) if arg.startswith("-") and equals else relative(arg)


def check_output(path: str) -> None:
  """Proves that results can be written to `path` (its directory exists and takes a file) before any
  model loads; a missing or read-only location otherwise fails after all the generation."""
  directory = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise ValueError(f"config.output {path} is a directory; give a file path")
  if not os.path.isdir(directory):
    raise ValueError(f"config.output {path}: directory {directory} does not exist")
  try:
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".specjax-write-test-"):
      pass
  except OSError as e:
    raise ValueError(f"config.output {path}: cannot write in {directory} ({e.strerror or e})") from None


def write_results(results: dict, path: str, log: Callable[[str], None]) -> str:
  """Writes `results` as JSON to `path`; if that fails, to a fallback file in the temporary directory
  (the generation is never lost). Returns the path written ("" if even the fallback failed)."""
  for target in (path,
                 os.path.join(tempfile.gettempdir(), f"specjax-results-{time.strftime('%Y%m%d-%H%M%S')}"
                              f"-{os.getpid()}.json")):
    try:
      with open(target, "w") as f:
        json.dump(results, f, indent=1)
      log(f"wrote {target}")
      return target
    except OSError as e:
      log(f"could not write {target}: {e.strerror or e}")
  return ""
