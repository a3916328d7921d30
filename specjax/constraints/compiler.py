"""Constraints on the host: a spec string -> a regular expression -> a token table for one vocabulary.

A spec is `"regex:PATTERN"` or `"json_schema:SCHEMA"` (SCHEMA: inline JSON, or the path of a JSON file);
a constraint given as a dict, `{"regex": PATTERN}` or `{"json_schema": SCHEMA}` (SCHEMA a dict too, as
OpenAI-style `response_format` and vLLM's guided decoding write it), becomes that string (`spec_of`).
A schema becomes a regular expression through `outlines_core.json_schema.build_regex_from_schema`. The
regular expression is compiled by `outlines_core.Index` into a byte-level DFA walked by every token's
bytes (`vocab_map.token_bytes`): for each DFA state reachable by whole tokens, which tokens may follow
and the state each leads to. That is the `TokenTable`, dense: `next_ZxV` holds Z x V int32 entries
(Z DFA states, V the target's vocabulary rows), 4 Z V bytes: 0.6 MB for a 30-state regex over the test
models, ~120 MB for a 200-state JSON schema over Qwen2.5's 151,936 rows. Tables above
`MAX_TABLE_BYTES` are refused rather than compressed (a compressed table is future work).

Tokens with no bytes (special, undefined and padding rows) are never allowed, except the EOS ids, which
are allowed exactly in accepting states (and leave the state unchanged). States from which no sequence of
tokens reaches an accepting state are pruned (with the tokens leading into them), so a constrained row
always has an allowed token and can always finish.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import outlines_core
from outlines_core.json_schema import build_regex_from_schema

from specjax.constraints.mask import Constrained, constrained, forced_tokens
from specjax.errors import ConfigError
from specjax.models import vocab_map
from specjax.models.tokenizer import Tokenizer

MAX_TABLE_BYTES = 1 << 30  # the largest dense table built (Z x V x 4 bytes)
KINDS = ("regex", "json_schema")
# The schema keywords `build_regex_from_schema` turns into the regex; any other is refused rather than
# silently ignored (outlines-core drops e.g. "patternProperties" without a word).
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems", "enum",
    "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "$schema", "$id", "title", "description",
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "default", "examples", "minProperties", "maxProperties", "minDigits", "maxDigits"
})
# Keywords whose value maps names to subschemas (their keys are names, not keywords).
_NAMED_SUBSCHEMAS = ("properties", "$defs", "definitions")
_END = "\U0010FFFF"  # a Unicode noncharacter: no text holds it (`compile_table`)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenTable:
  """One constraint over one vocabulary: state 0 is the start state."""

  next_ZxV: np.ndarray  # int32 [Z, V]: the state after token v in state z; -1 = v is not allowed there
  accepting_Z: np.ndarray  # bool [Z]: the text so far matches the whole constraint (EOS is allowed)
  regex: str  # the regular expression it was compiled from

  @property
  def num_states(self) -> int:
    return self.next_ZxV.shape[0]


def stack(tables: Sequence[TokenTable]) -> tuple[np.ndarray, np.ndarray]:
  """One table of several constraints (`next_ZxV` of all states, each table's renumbered past the ones
  before it) and the start state of each [len(tables)]: rows of a batch with different constraints."""
  offsets = np.cumsum([0] + [t.num_states for t in tables])
  parts = [np.where(t.next_ZxV >= 0, t.next_ZxV + offset, -1) for t, offset in zip(tables, offsets)]
  return np.concatenate(parts).astype(np.int32), offsets[:-1].astype(np.int32)


def spec_of(value: Any, field: str = "constraint") -> str:
  """The spec string of a constraint given as a spec string, as a dict with one key (`{"regex": PATTERN}`,
  `{"json_schema": SCHEMA}`, SCHEMA a dict, inline JSON or a file path) or as None or "" (none: "").
  Checked by `parse`; a ConfigError of one line naming `field` for any other value."""
  if value is None or isinstance(value, str) and not value:
    return ""
  if isinstance(value, Mapping):
    if len(value) != 1 or next(iter(value)) not in KINDS:
      raise ConfigError(f"{field} must be a dict with one key, 'regex' or 'json_schema', got keys "
                        f"{sorted(map(str, value))}")
    (kind, body), = value.items()
    if kind == "json_schema" and isinstance(body, Mapping):
      try:
        body = json.dumps(body)  # the schema's own key order: it orders the properties of the output
      except (TypeError, ValueError) as e:
        raise ConfigError(f"{field}: json_schema is not JSON: {e}") from None
    if not isinstance(body, str):
      expected = "a string" if kind == "regex" else "a dict or a string (inline JSON or a file)"
      raise ConfigError(f"{field}: {kind} must be {expected}, got {body!r:.60}")
    value = f"{kind}:{body}"
  elif not isinstance(value, str):
    raise ConfigError(f"{field} must be a string (\"regex:...\", \"json_schema:...\") or a dict ({{\"regex\": ...}}, "
                      f"{{\"json_schema\": {{...}}}}), got {value!r:.60}")
  parse(value, field)
  return value


def parse(spec: str, field: str = "config.constraint") -> str:
  """The regular expression of a spec (`"regex:..."` or `"json_schema:..."`); ConfigError naming
  `field` for an unknown kind, a schema that is not valid JSON Schema or uses unsupported keywords."""
  kind, sep, body = spec.partition(":")
  if not sep or kind not in KINDS:
    raise ConfigError(f"{field} must start with one of {', '.join(k + ':' for k in KINDS)}, got {spec[:40]!r}")
  if kind == "regex":
    try:  # outlines-core's own error says only "Failed to build DFA"; Python's names what is wrong, and where
      re.compile(body)
    except re.error as e:
      raise ConfigError(f"{field}: invalid regular expression {body[:60]!r}: {e.msg} at position {e.pos}") from None
    return body
  text = body
  if not body.lstrip().startswith("{"):
    if not os.path.isfile(body):
      raise ConfigError(f"{field}: json_schema is neither inline JSON nor a file: {body!r}")
    with open(body) as f:
      text = f.read()
  try:
    schema = json.loads(text)
    jsonschema.validators.validator_for(schema).check_schema(schema)
  except (json.JSONDecodeError, jsonschema.SchemaError) as e:
    raise ConfigError(f"{field}: invalid JSON schema: {str(e).splitlines()[0]}") from None
  unsupported = sorted(_keywords(schema) - SCHEMA_KEYWORDS)
  if unsupported:
    raise ConfigError(f"{field}: unsupported JSON schema keywords {unsupported}")
  try:
    return build_regex_from_schema(json.dumps(schema))
  except (ValueError, TypeError) as e:
    raise ConfigError(f"{field}: {e}") from None


def _keywords(schema) -> set[str]:
  """Every keyword used in a schema and its subschemas."""
  if isinstance(schema, list):
    return set().union(*map(_keywords, schema)) if schema else set()
  if not isinstance(schema, dict):
    return set()
  found = set(schema)
  for key, value in schema.items():
    if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
      found |= set().union(*map(_keywords, value.values())) if value else set()
    elif key not in ("enum", "const", "default", "examples", "required") and isinstance(value, (dict, list)):
      found |= _keywords(value)
  return found


def compile_table(regex: str, strings: Sequence[bytes], eos_ids: Sequence[int],
                  field: str = "config.constraint") -> TokenTable:
  """The token table of `regex` over a vocabulary whose id v spells `strings[v]` (b"" = never allowed
  but as an EOS id). ConfigError naming `field` for an invalid regex, one no token sequence can match,
  or a table above `MAX_TABLE_BYTES`."""
  eos_ids = sorted({int(e) for e in eos_ids if 0 <= e < len(strings)})
  if not eos_ids:
    raise ConfigError(f"{field}: the tokenizer has no EOS id inside the vocabulary: a constrained row could not end")
  by_bytes: dict[bytes, list[int]] = {}
  for i, data in enumerate(strings):
    if data and i not in eos_ids:
      by_bytes.setdefault(bytes(data), []).append(i)
  # outlines-core 0.2.14's Index drops the moves out of its final states into non-final ones (for
  # "a(xb)*" it omits "x" after "a"), so the regex is compiled followed by END, a noncharacter that no
  # token spells, given to it as a token of its own: a state is accepting iff END leads to a final state,
  # and the only final states are those after END, which the table leaves out.
  end = len(strings)
  try:
    index = outlines_core.Index(f"(?:{regex}){_END}",
                                outlines_core.Vocabulary(end + 1, {**by_bytes, _END.encode(): [end]}))
  except ValueError as e:  # a pattern Python accepts but outlines-core (Rust's regex syntax) does not
    message = str(e).split(". Found")[0].replace(_END, "")
    raise ConfigError(f"{field}: {message} for {regex[:60]!r} (outlines-core takes Rust's regex syntax: no "
                      f"lookaround, no backreferences)") from None
  transitions, finals = index.get_transitions(), set(index.get_final_states())
  start = index.get_initial_state()
  states = [start] + sorted(set(transitions) - finals - {start})
  number = {s: z for z, s in enumerate(states)}
  if len(states) * len(strings) * 4 > MAX_TABLE_BYTES:
    raise ConfigError(f"{field}: {len(states)} DFA states x {len(strings)} tokens exceed the dense table's "
                      f"{MAX_TABLE_BYTES >> 20} MiB")
  next_ZxV = np.full((len(states), len(strings)), -1, np.int32)
  accepting_Z = np.zeros(len(states), bool)
  for s, z in number.items():
    moves = {i: t for i, t in transitions.get(s, {}).items() if i < end}
    accepting_Z[z] = transitions.get(s, {}).get(end) in finals
    if moves:
      next_ZxV[z, list(moves)] = [number.get(t, -1) for t in moves.values()]
  next_ZxV[:, eos_ids] = np.where(accepting_Z, np.arange(len(states)), -1)[:, None]
  next_ZxV = _prune(next_ZxV, accepting_Z)
  if not (next_ZxV[0] >= 0).any():
    raise ConfigError(f"{field}: no token sequence of this vocabulary matches the constraint")
  return TokenTable(next_ZxV, accepting_Z, regex)


def _prune(next_ZxV: np.ndarray, accepting_Z: np.ndarray) -> np.ndarray:
  """`next_ZxV` without the moves into states that cannot reach an accepting state by tokens."""
  live_Z = accepting_Z.copy()
  while True:
    reaches_Z = live_Z | ((next_ZxV >= 0) & live_Z[np.maximum(next_ZxV, 0)]).any(axis=1)
    if (reaches_Z == live_Z).all():
      break
    live_Z = reaches_Z
  return np.where((next_ZxV >= 0) & live_Z[np.maximum(next_ZxV, 0)], next_ZxV, -1).astype(np.int32)


_FIELD = "\0field"  # the field a cached compile's errors name, replaced by the caller's (`table_for`)


@functools.lru_cache(maxsize=32)
def _cached(spec: str, strings: tuple[bytes, ...], eos_ids: tuple[int, ...]) -> TokenTable:
  return compile_table(parse(spec, _FIELD), strings, eos_ids, _FIELD)


def table_for(spec: str, strings: Sequence[bytes], eos_ids: Sequence[int],
              field: str = "config.constraint") -> TokenTable:
  """`compile_table(parse(spec))`, cached by (spec, vocabulary, EOS ids): compiled once per process,
  whichever field gave it; a ConfigError names `field`."""
  try:
    return _cached(spec, tuple(strings), tuple(sorted(set(eos_ids))))
  except ConfigError as e:
    raise ConfigError(str(e).replace(_FIELD, field, 1)) from None


def token_strings(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
  """The bytes each of the model's `vocab_size` ids spells in text (`vocab_map.token_bytes`); b"" for
  special and undefined ids, which no constraint allows (but EOS in accepting states)."""
  vocab = vocab_map.token_bytes(tokenizer, vocab_size)
  spelled = (vocab_map.NORMAL, vocab_map.ADDED)
  return [data if kind in spelled else b"" for data, kind in zip(vocab.strings, vocab.kind_V)]


@dataclasses.dataclass(frozen=True, eq=False)
class RunConstraints:
  """The constraints of a run's prompts stacked into one table, so that every batch runs one compiled
  program whichever constraints its rows carry; an unconstrained row ("") starts in a free state that
  allows every id."""

  next_ZxV: np.ndarray  # int32 [Z, V]: every constraint's table (`stack`), the free state's last
  start_of: dict[str, int]  # each spec's start state ("" -> the free state)

  @functools.cached_property
  def _device_tables(self) -> tuple[jax.Array, jax.Array]:
    """The table and its forced tokens on the device, copied and derived once, not per batch."""
    return jnp.asarray(self.next_ZxV), jnp.asarray(forced_tokens(self.next_ZxV))

  def rows(self, specs: Sequence[str]) -> Constrained:
    """The device constraint of a batch whose row b carries `specs[b]`."""
    return constrained(self._device_tables[0], [self.start_of[spec] for spec in specs], self._device_tables[1])


def for_run(specs: Sequence[str], strings: Sequence[bytes], eos_ids: Sequence[int],
            fields: str | Sequence[str] = "config.constraint") -> RunConstraints | None:
  """The stacked constraints of a run's prompts (`specs`: one per prompt, "" = none); None when no
  prompt is constrained. Each distinct spec compiles once (`table_for`); its errors name the field
  of its first prompt (`fields`: one per prompt, or one for all)."""
  fields = [fields] * len(specs) if isinstance(fields, str) else list(fields)
  field_of = {}
  for spec, field in zip(specs, fields):
    field_of.setdefault(spec, field)
  distinct = sorted(set(specs) - {""})
  if not distinct:
    return None
  free = TokenTable(np.zeros((1, len(strings)), np.int32), np.ones(1, bool), "")
  next_ZxV, starts = stack([table_for(spec, strings, eos_ids, field_of[spec]) for spec in distinct] + [free])
  return RunConstraints(next_ZxV, {**dict(zip(distinct, starts.tolist())), "": int(starts[-1])})
