"""Which class `config.drafter` names: a registered name ("model", "ngram", "suffix", "layer_skip", "eagle",
"parallel", "dflash", "quantized", "levels", or any `Drafter` subclass with a class attribute `name`, registered when
its module is imported) or an import path "package.module:ClassName", so a drafter in a researcher's own file plugs into
`python -m specjax.decode`, `specjax.Decoder`, the sweeps and the benchmarks without editing specjax.
"""

from __future__ import annotations

import importlib

from specjax.errors import ConfigError
from specjax.speculative.drafters.base import REGISTERED, Drafter

# The modules of specjax.speculative.drafters that define the built-in drafters (imported on first use).
BUILTIN_MODULES = ("model", "ngram", "suffix", "layer_skip", "eagle", "parallel", "dflash", "quantized", "levels")


def builtin() -> dict[str, type]:
  """Every registered drafter class by name: the built-in ones first, in `BUILTIN_MODULES` order."""
  modules = [f"specjax.speculative.drafters.{module}" for module in BUILTIN_MODULES]
  for module in modules:
    importlib.import_module(module)
  order = {
      name: (modules.index(cls.__module__) if cls.__module__ in modules else len(modules), i)
      for i, (name, cls) in enumerate(REGISTERED.items())
  }
  return dict(sorted(REGISTERED.items(), key=lambda item: order[item[0]]))


def names() -> tuple[str, ...]:
  return tuple(builtin())


def resolve(name: str) -> type:
  """The Drafter class `config.drafter` names; a `ConfigError` naming the field otherwise."""
  classes = builtin()
  if name in classes:
    return classes[name]
  if ":" not in name:
    raise ConfigError(f"unknown config.drafter {name!r}; expected one of {', '.join(classes)} or an import "
                      f"path package.module:ClassName")
  module_name, _, class_name = name.partition(":")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ConfigError(f"config.drafter {name!r}: cannot import {module_name} ({e})") from None
  cls = getattr(module, class_name, None)
  if not (isinstance(cls, type) and issubclass(cls, Drafter)):
    what = "nothing" if cls is None else f"a {type(cls).__name__}"
    raise ConfigError(f"config.drafter {name!r}: {module_name}.{class_name} is {what}, not a subclass of "
                      f"specjax.speculative.Drafter")
  return cls
