"""Driving `specjax.decode`: two tiny Qwen2 directories with the character tokenizer (the module fixtures
`model_dirs`, and `chat_model_dirs` with a chat template; import one into a test module to use it
there), the tiny decode config for them, and the
CLI started in a subprocess from the repository root or run in this process."""

import contextlib
import io
import os
import subprocess
import sys

import ml_collections
import pytest

from configs import tiny
from specjax.api import apply_fields
from tests.helpers.tiny_hf import CHAT_TEMPLATE, save_char_tokenizer, save_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model_dirs(tmp_path_factory, chat_template: str | None = None) -> list[str]:
  dirs = []
  for name, seed in (("target", 0), ("draft", 1)):
    directory = str(tmp_path_factory.mktemp(name))
    save_hf_model("qwen2", directory, seed=seed)
    save_char_tokenizer(directory, chat_template)
    dirs.append(directory)
  return dirs


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
  """[target, draft]: tiny random Qwen2 directories (seeds 0 and 1) with the character tokenizer."""
  return _model_dirs(tmp_path_factory)


@pytest.fixture(scope="module")
def chat_model_dirs(tmp_path_factory):
  """`model_dirs` whose tokenizer has a chat template (`tiny_hf.CHAT_TEMPLATE`)."""
  return _model_dirs(tmp_path_factory, CHAT_TEMPLATE)


def cli_config(model_dirs, **overrides) -> ml_collections.ConfigDict:
  """configs/tiny.py for the [target, draft] directories `model_dirs`, with `overrides` (fields, a
  drafter's group as a dict, as `specjax.Decoder` takes them)."""
  cfg = tiny.get_config()
  cfg.target, cfg.draft = model_dirs
  return apply_fields(cfg, overrides)


def run_cli(arguments, env=None):
  """Starts `python -m specjax.decode ARGUMENTS` from the repository root (returns the process), with
  `env` added to the environment (a None value removes that variable; SPECJAX_DEBUG is off)."""
  env = {
      name: value
      for name, value in {**os.environ, **(env or {})}.items()
      if name != "SPECJAX_DEBUG" and value is not None
  }
  env.update(JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-m", "specjax.decode", *arguments], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def decode_in_process(arguments) -> tuple[int, str]:
  """`python -m specjax.decode ARGUMENTS` through the module's own entry point (`cli.run(decode.main, ...)`:
  absl parsing, the config checks, the one-line `error:`) in this process, without a new interpreter:
  (exit status, stderr). The `--config.FIELD` override flags an earlier parse defined are dropped first,
  as a fresh process would not have them (absl refuses to define a flag twice)."""
  from absl import flags

  from specjax import cli, decode, decode_config

  for name in [name for name in flags.FLAGS if name.startswith(decode._CONFIG.name + ".")]:
    delattr(flags.FLAGS, name)
  stderr, argv = io.StringIO(), sys.argv
  sys.argv = ["specjax.decode", *arguments]
  try:
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
      cli.run(decode.main, decode._CONFIG, moved=decode_config.moved)
    status = 0
  except SystemExit as e:
    status = 0 if e.code is None else e.code  # absl exits through sys.exit(None) on success
  finally:
    sys.argv = argv
  return status, stderr.getvalue()
