"""What every result file records besides its numbers: the machine and library versions, and the command
that made it, with paths relative to the repository root so records name no machine's directories."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import jax


def environment() -> dict[str, Any]:
  """Machine and versions, recorded with every result."""
  import flax
  import transformers

  return {"jax": jax.__version__, "flax": flax.__version__, "transformers": transformers.__version__,
          "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
          "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
          "python": platform.python_version()}


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
