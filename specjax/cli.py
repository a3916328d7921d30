"""One error path for every specjax command line (`specjax.decode`, `specjax.distill`, experiments).

A user error (a bad config value, an unknown config field, a missing or malformed file, a damaged
checkpoint, a model that cannot be loaded) ends the program with one line on stderr, `error: ...`,
naming the field or the file, and exit status 2 (usage: the command line or config is wrong) or 1
(data: a file, checkpoint or model is). Tracebacks are for developers: set `SPECJAX_DEBUG=1` to get
them instead. Library log noise (absl INFO lines such as JAX's "Unable to initialize backend 'tpu'")
is hidden unless `--verbosity` is given.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from typing import Callable, NoReturn, Sequence

import ml_collections
from absl import app, flags, logging

from specjax.errors import ConfigError

DEBUG_ENV = "SPECJAX_DEBUG"  # "1": re-raise user errors with their traceback
USAGE, DATA = 2, 1  # exit statuses

# Errors a user can cause with a valid program: reported in one line. Anything else is a bug and keeps
# its traceback.
USER_ERRORS = (ValueError, OSError, FloatingPointError)


def debugging() -> bool:
  return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def fail(message: str, status: int) -> NoReturn:
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(status)


def run(main: Callable[[ml_collections.ConfigDict], None], config: flags.FlagHolder,
        moved: Callable[[str], str | None] = lambda path: None) -> None:
  """`absl.app.run` for a program whose only input is `--config` (a file) and its `--config.FIELD`
  overrides; `main(config)` does the work. Exits 0, or 1/2 with one `error:` line. `moved(path)` is
  the error for a field that moved elsewhere (None for other names), so an old name says where it went."""
  def parse(argv: list[str]) -> list[str]:
    try:
      return flags.FLAGS(argv)
    except Exception as e:  # noqa: BLE001 -- ml_collections raises KeyError/AttributeError/TypeError
      if debugging():
        raise
      fail(_parse_error_message(argv, e, config.name, moved), USAGE)

  def guarded(argv: list[str]) -> None:
    if len(argv) > 1:
      fail(f"unexpected arguments {argv[1:]}; settings go in --{config.name}.FIELD=VALUE", USAGE)
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    if config.value is None:
      fail(f"--{config.name}=configs/<name>.py is required", USAGE)
    try:
      main(config.value)
    except USER_ERRORS as e:
      if debugging():
        raise
      fail(_one_line(e), USAGE if isinstance(e, ConfigError) else DATA)

  app.run(guarded, flags_parser=parse)


def _one_line(error: BaseException) -> str:
  message = str(error) or type(error).__name__
  if isinstance(error, OSError) and error.filename and str(error.filename) not in message:
    message = f"{error.filename}: {message}"
  return " ".join(message.split())


def _parse_error_message(argv: Sequence[str], error: Exception, flag_name: str, moved: Callable[[str],
                                                                                                str | None]) -> str:
  """The message for a command line absl or ml_collections refused: the unknown field when there is
  one (with the closest known names), else the parser's own message."""
  if isinstance(error, flags.Error):
    return _one_line(error)
  config_file, overrides = _config_arguments(argv, flag_name)
  if config_file:
    try:
      config = load_config_file(config_file)
    except Exception as e:  # noqa: BLE001 -- a config file's own error is reported as it is
      return f"cannot load --{flag_name}={config_file}: {_one_line(e)}"
    for path in overrides:
      unknown = unknown_field(config, path)
      if unknown:
        return moved(path) or unknown
  return _one_line(error)


def _config_arguments(argv: Sequence[str], flag_name: str) -> tuple[str, list[str]]:
  """(the --config file argument, the dotted paths of every --config.PATH override) in `argv`."""
  config_file, overrides = "", []
  for i, arg in enumerate(argv):
    name, has_value, value = arg.lstrip("-").partition("=")
    if not arg.startswith("-"):
      continue
    if name == flag_name:
      config_file = value if has_value else (argv[i + 1] if i + 1 < len(argv) else "")
    elif name.startswith(flag_name + "."):
      overrides.append(name[len(flag_name) + 1:])
  return config_file, overrides


def load_config_file(argument: str) -> ml_collections.ConfigDict:
  """`get_config()` (or `get_config(arg)` for `FILE:arg`) of a config file, as ml_collections does."""
  path, _, arg = argument.partition(":")
  spec = importlib.util.spec_from_file_location("_specjax_config", path)
  if spec is None or not os.path.isfile(path):
    raise FileNotFoundError(f"config file {path}: no such file")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def unknown_field(config: ml_collections.ConfigDict, path: str) -> str | None:
  """A message naming the first component of the dotted `path` that `config` lacks, with a close-match
  suggestion and the fields known at that level; None when the whole path exists."""
  node, walked = config, []
  for part in path.split("."):
    if not isinstance(node, ml_collections.ConfigDict):
      return f"config field '{'.'.join(walked)}' is a {type(node).__name__}, not a group of fields"
    if part not in node:
      known = sorted(node.keys())
      close = difflib.get_close_matches(part, known, n=1)
      hint = f" (did you mean '{'.'.join(walked + close)}'?)" if close else ""
      where = f" of '{'.'.join(walked)}'" if walked else ""
      return (f"unknown config field '{'.'.join(walked + [part])}'{hint}; known fields{where}: "
              f"{', '.join(known)}")
    node, walked = node[part], walked + [part]
  return None
