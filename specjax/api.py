"""`specjax.Decoder`: load the models once, generate many times, from a notebook or a script.

    import specjax
    dec = specjax.Decoder(target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct")
    out = dec.generate(["def quicksort(xs):"], max_new_tokens=64, temperature=0.0)
    out.texts, out.token_ids, out.stats   # stats: tokens/s, alpha_hat, mean accepted length, ...

Keyword arguments are decode-config fields (`specjax.decode_config`): top-level ones by name, a
drafter's group as a dict (`ngram={"min": 2}`) or by dotted name (`**{"ngram.min": 2}`), with the
same one-line `ConfigError`s as the command line. `drafter` is a registered name, an import path
"package.module:ClassName" or a built Drafter instance. `generate` may change anything but the fields
that decide which models are loaded and how (`decode_spec.LOAD_FIELDS`): the models stay loaded, a
drafter is built once per distinct setting, and what does not recompile on the command line does not
recompile here (sampling knobs, budgets up to the compiled width, prompts of the same padded shape).
`generate` takes strings or `specjax.Request`s (a prompt with its own constraint, budget and sampling
knobs), held in memory: nothing is written to a file. `python -m specjax.decode` is a thin layer over
`Decoder.from_config` and `Decoder.run`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import ml_collections

from specjax import decode_config, decode_spec, mesh as meshes, pipeline, session
from specjax.cli import unknown_field
from specjax.constraints import compiler
from specjax.decode_spec import DecodeSpec
from specjax.errors import ConfigError
from specjax.prompts import Request
from specjax.speculative.drafters.base import Drafter


@dataclasses.dataclass(frozen=True)
class Generation:
  """What one `Decoder.generate` call produced."""

  texts: list[str]  # the generated text of each prompt (the prompt and special tokens such as EOS excluded)
  token_ids: list[list[int]]  # its token ids (EOS included when hit)
  stats: dict[str, Any]  # tokens_per_second, alpha_hat, mean_accepted_length, per_position_acceptance, ...
  results: dict[str, Any]  # everything `pipeline.run` returns: per-prompt stats, the config, the machine


def apply_fields(cfg: ml_collections.ConfigDict, fields: dict[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `cfg` with `fields` set: names or dotted names, a dict for a whole group (`constraint`
  may be a dict: `compiler.spec_of`). Unknown and renamed fields, and values of the wrong type, fail
  with one line naming the field."""
  cfg = decode_spec.unlocked_copy(cfg)  # a drafter by import path may add its group
  flat: dict[str, Any] = {}
  for name, value in fields.items():
    if name == "constraint":
      flat[name] = compiler.spec_of(value, "config.constraint")
    elif isinstance(value, dict):
      flat.update({f"{name}.{inner}": v for inner, v in value.items()})
    else:
      flat[name] = value
  for path, value in flat.items():
    if decode_config.moved(path):
      raise ConfigError(decode_config.moved(path))
    if path == "drafter" and isinstance(value, str) and cfg.get("mode") == "speculative":
      cfg.drafter = value
      cfg = decode_spec.with_drafter_group(cfg)
      continue
    message = unknown_field(cfg, path)
    if message:
      raise ConfigError(message)
    try:
      decode_spec.set_field(cfg, path, tuple(value) if isinstance(value, list) else value)
    except (TypeError, ValueError) as e:
      raise ConfigError(f"config.{path}: {e}") from None
  return cfg


class Decoder:
  """A target (and a draft model when the drafter needs one) loaded once, generating many times."""
  def __init__(self, target: str | None = None, drafter: str | Drafter | None = None, draft: str | None = None, *,
               config: ml_collections.ConfigDict | None = None, log: Callable[[str], None] | None = None, **fields):
    """`config` (default: `decode_config.default_config()`) with `target`, `drafter`, `draft` and
    `fields` set; loads the models at once."""
    silent = lambda message: None
    self._log = (log or silent) if meshes.is_main_process() else silent
    self._drafter_instance = drafter if isinstance(drafter, Drafter) else None
    given = {name: value for name, value in (("target", target), ("draft", draft)) if value is not None}
    if isinstance(drafter, str):
      given["drafter"] = drafter
    elif self._drafter_instance is not None:
      given["drafter"] = type(drafter).registered_as()
    self._config = apply_fields(config if config is not None else decode_config.default_config(), {**given, **fields})
    spec = self._spec(self._config)
    pipeline.check_inputs(spec)  # a bad prompts file or output location fails before the models load
    self.target, self.draft = pipeline.load_models(spec, self._log)
    # One session per compiled program (its caches, the K policy's memory, the widths warmed up) and
    # one built drafter per drafter setting, with what it learned (`specjax.session`).
    given = None if self._drafter_instance is None else session.BuiltDrafter(self._drafter_instance, {})
    self._sessions = session.Sessions((self.target, self.draft), given, self._log)

  @classmethod
  def from_config(cls, cfg: ml_collections.ConfigDict, log: Callable[[str], None] | None = None) -> Decoder:
    return cls(config=cfg, log=log)

  @property
  def config(self) -> ml_collections.FrozenConfigDict:
    """The decode config the models were loaded for."""
    return ml_collections.FrozenConfigDict(self._config)

  def _spec(self, cfg: ml_collections.ConfigDict) -> DecodeSpec:
    return decode_spec.from_config(cfg, self._drafter_instance)

  def run(self, **fields) -> dict[str, Any]:
    """Decodes the config's own prompts (`prompts` or `prompts_file`), with `fields` changed; returns
    `pipeline.run`'s results (also written to `output` when set)."""
    return self._run(fields)

  def _run(self, fields: dict[str, Any], requests: Sequence[Request] | None = None) -> dict[str, Any]:
    """`pipeline.run` of the config with `fields` changed, on `requests` (default: the config's prompts)."""
    cfg = apply_fields(self._config, fields)
    for name in decode_spec.LOAD_FIELDS:
      if cfg[name] != self._config[name]:
        raise ConfigError(f"config.{name} changes the loaded models ({self._config[name]!r} -> {cfg[name]!r}): "
                          f"make a new Decoder")
    spec = self._spec(cfg)
    if spec.loads_draft_model and self.draft is None:
      raise ConfigError(f"config.drafter {cfg.drafter!r} needs a draft model, which this Decoder did not load: "
                        f"make a new Decoder with it")
    return pipeline.run(spec, self._log, sessions=self._sessions, requests=requests)

  def reset_pool(self) -> None:
    """Forgets the sequences earlier calls taught the drafters (`Drafter.forget`: a suffix drafter's pool
    is emptied; its warm-start corpus too). Every call's prompts and outputs go to the pool of a pool
    drafter, for the calls after it."""
    self._sessions.forget()

  def generate(self, prompts: str | Request | Sequence[str | Request], **fields) -> Generation:
    """Decodes `prompts` (a string, a `specjax.Request`, or a sequence of them) with `fields` changed for
    this call only. `constraint` (docs/constraints.md) is a string or a dict for every prompt, or a list
    of them, one per prompt (None: unconstrained); a request's own constraint is given in the request,
    as are its own `max_new_tokens`, `temperature`, `top_k` and `top_p` (None: the call's; runtime values
    of one program that serves every request: greedy only if all are, a filter on if any uses it). An
    error names the field and the request: `constraint of request 2 must ...`."""
    items = (prompts,) if isinstance(prompts, (str, Request)) else tuple(prompts)
    constraint = fields.get("constraint")
    per_prompt = isinstance(constraint, (list, tuple))
    if per_prompt:
      if len(constraint) != len(items):
        raise ConfigError(f"constraint: {len(constraint)} constraints for {len(items)} prompts (give one per "
                          f"prompt, or one for all)")
      fields = {**fields, "constraint": ""}
    requests = []
    for i, item in enumerate(items):
      own, source = constraint[i] if per_prompt else None, f"request {i + 1}"
      if not isinstance(item, Request):
        requests.append(Request(item, own, source=source))
        continue
      if own is not None and item.constraint:
        raise ConfigError(f"constraint of {source} is given twice: in the request and in the constraint list")
      requests.append(dataclasses.replace(item, constraint=item.constraint or own, source=item.source or source))
    results = self._run({**fields, "prompts": tuple(r.turns[0] for r in requests), "prompts_file": ""}, requests)
    outputs = results["outputs"]
    return Generation(texts=[o["text"] for o in outputs], token_ids=[o["token_ids"] for o in outputs],
                      stats=results["stats"], results=results)
