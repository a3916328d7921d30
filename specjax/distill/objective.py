"""The Objective interface: what one trainable drafter family brings to a distillation run, chosen by name.

`config.student.init` names a registered `Objective` subclass (`resolve`: one lookup). The run
(`specjax.distill.train`) owns the resumable loop, checkpoints, metrics and logging; the objective owns
everything that differs between families, on the host:

  check(config)                   classmethod: its student settings, a `ConfigError` naming the field
  init(teacher, part)             (student config, initial params) from the teacher: a ModelConfig, or an
                                  EagleConfig for a head; laid out by `part` on a mesh
  labels(student_config, params)  TRAIN / FROZEN per parameter (default: everything trains)
  prepare(workdir, teacher, rows) what it takes from the training rows before step 1 (default: nothing)
  steps(context)                  `Steps`: its train and eval steps, one signature for every family
  run_params(student_config, master)   the float32 master as the draft runs: what generates and is exported
  export(directory, student_config, params, teacher)   the draft, for `specjax.decode`
  latest(teacher, student_config, master, step, part)  the draft of a checkpoint, as `train.latest` returns it

and two class attributes: `generates` (its draft continues rows: the on-policy `data.modes.student`)
and `owns` (config.student fields that only it reads: set away from their default under another
objective, they are an error naming the field).

A subclass registers when its module is imported, under its class attribute `name`. The built-in ones
live in `specjax.distill.objectives` (`BUILTIN_MODULES`, imported on first use); a researcher's own
module registers by being imported, e.g. from the config file that names it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, ClassVar, NamedTuple

import jax
import ml_collections

from specjax.distill.config import default_config
from specjax.distill.student import TRAIN
from specjax.errors import ConfigError

if TYPE_CHECKING:
  from specjax.distill.data import Packed
  from specjax.distill.steps import Optimizer, Placement
  from specjax.models.config import ModelConfig
  from specjax.models.load import LoadedModel
  from specjax.models.transformer import Params
  from specjax.partitioning import Partitioning

# The modules of specjax.distill.objectives that define the built-in objectives.
BUILTIN_MODULES = ("draft_model", "parallel", "eagle", "dflash")
REGISTERED: dict[str, type[Objective]] = {}  # every Objective subclass with a `name`, by name


class Steps(NamedTuple):
  """An objective's compiled steps, the same signature for every family:

  train(state, teacher_params, tokens_BxT, mask_BxT) -> (state, metrics): `state` (a `steps.TrainState`)
      donated; metrics "loss", "grad_norm", "learning_rate" (float32 scalars)
  eval(master, teacher_params, tokens_BxT, mask_BxT) -> sums over the batch, summed over batches:
      "tokens" and each metric's sum (the means divide by "tokens"); per draft position [K]
      "<metric>_at" divided by "tokens_at"
  """

  train: Callable
  eval: Callable


class StepContext(NamedTuple):
  """What an objective's steps are built from: the family-neutral pieces of the run."""

  teacher: ModelConfig
  student: Any  # the student's config (`Objective.init`'s)
  labels: Any  # TRAIN / FROZEN per student parameter (`Objective.labels`)
  optimizer: Optimizer
  placement: Placement | None  # on a mesh (`steps.Placement`), else None


class Objective:
  """One distillation objective for the run's `config` (the whole ConfigDict); see the module docstring."""

  name: ClassVar[str] = ""  # the config.student.init value that selects it ("" = not registered)
  generates: ClassVar[bool] = False  # its draft generates rows (the 'student' data mode)
  owns: ClassVar[tuple[str, ...]] = ()  # config.student fields only this objective reads

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.__dict__.get("name"):
      REGISTERED[cls.name] = cls

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config

  @classmethod
  def check(cls, config: ml_collections.ConfigDict) -> None:
    """Raises a `ConfigError` naming the field of a setting this objective cannot train with."""

  def init(self, teacher: LoadedModel, part: Partitioning | None) -> tuple[Any, Params]:
    raise NotImplementedError

  def labels(self, student_config: Any, params: Params) -> Any:
    return jax.tree.map(lambda _: TRAIN, params)

  def prepare(self, workdir: str, teacher: LoadedModel, train_rows: Packed) -> None:
    """Takes what the objective needs from the training rows (kept in `workdir` for `latest`)."""

  def steps(self, context: StepContext) -> Steps:
    raise NotImplementedError

  def run_params(self, student_config: Any, master: Params) -> Params:
    raise NotImplementedError

  def export(self, directory: str, student_config: Any, params: Params, teacher: LoadedModel) -> None:
    raise NotImplementedError

  def latest(self, teacher: LoadedModel, student_config: Any, master: Params, step: int,
             part: Partitioning | None) -> tuple:
    raise NotImplementedError


def builtin() -> dict[str, type[Objective]]:
  """Every registered objective by name: the built-in ones first, in `BUILTIN_MODULES` order."""
  modules = [f"specjax.distill.objectives.{module}" for module in BUILTIN_MODULES]
  for module in modules:
    importlib.import_module(module)
  rank = lambda item: modules.index(item[1].__module__) if item[1].__module__ in modules else len(modules)
  return dict(sorted(REGISTERED.items(), key=rank))  # a stable sort: registration order within a module


def resolve(name: str) -> type[Objective]:
  """The Objective `config.student.init` names; a `ConfigError` naming the field otherwise."""
  objectives = builtin()
  if name not in objectives:
    raise ConfigError(f"unknown student.init {name!r}; expected one of {tuple(objectives)}")
  return objectives[name]


def check(config: ml_collections.ConfigDict) -> type[Objective]:
  """The objective `config.student.init` names, once the student settings it cannot use are refused:
  another objective's own fields, the 'student' data mode when it generates nothing, and its checks."""
  cls, defaults = resolve(config.student.init), default_config().student
  for other in builtin().values():
    for field in other.owns if other is not cls else ():
      value, default = config.student.get(field), defaults.get(field)
      if value != default:
        raise ConfigError(f"config.student.{field} = {value!r} is a setting of student.init {other.name!r} only "
                          f"(this run's is {cls.name!r}): leave it at {default!r}")
  if config.data.modes.student > 0 and not cls.generates:
    raise ConfigError(f"student.init {cls.name!r} generates no rows (the on-policy 'student' data mode needs a "
                      f"draft model): set config.data.modes.student = 0, got {config.data.modes.student}")
  cls.check(config)
  return cls
