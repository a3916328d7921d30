"""What a decode decodes: requests (a prompt or a conversation, its own constraint, fields for its
outputs), where they come from, and how each turn of a conversation becomes the model's input.

`Request` is the one in-memory form: `specjax.Decoder.generate` takes strings or requests, and every
source parses into requests (`config.prompts_file` overrides `config.prompts`):
  config.prompts         a tuple of strings, one turn each
  a text file            one prompt per non-empty line
  a .jsonl file          one object per non-empty line with a "prompt" string, or a "turns" list of
                         strings (a multi-turn conversation, as FastChat's MT-Bench question.jsonl), and
                         optionally a "constraint" (a string or a dict, as `Request.constraint`), a
                         "max_new_tokens" (`Request.max_new_tokens`) and sampling knobs "temperature",
                         "top_k", "top_p" (as `Request`'s)
  "mt-bench"             the MT-Bench questions (`python -m specjax.data fetch mt-bench`), all 80, or a
                         selection: "mt-bench?category=coding,math&per_category=2"
Turn t is decoded from the chat template of the first t user messages with the model's own answers to
the earlier ones (decoded without special tokens, stripped, re-encoded: MT-Bench's second turn as FastChat
and EAGLE build it), so every turn after the first depends on what was generated before it.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
from typing import Any, Mapping, Sequence

from specjax.constraints import compiler
from specjax.data import mtbench, registry
from specjax.errors import ConfigError
from specjax.models.tokenizer import Tokenizer
from specjax.sampling import Knobs, knob_error

MT_BENCH = "mt-bench"
OWN_FIELDS = ("max_new_tokens", *Knobs._fields)  # a .jsonl record's fields that override the call's
ANSWER_SLACK = 16  # tokens an answer may gain when its text is re-encoded for the next turn


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt (or conversation) to decode, with what belongs to it alone; checked when made, so a
  bad value fails at once, in one line naming its field (and `source`: `constraint of request 2`).

      specjax.Request("Extract the person as JSON: Maria is 34.",
                      constraint={"json_schema": {"type": "object", "properties": {"age": {"type": "integer"}}}})
  """

  prompt: str | tuple[str, ...]  # one user message, or a conversation's, one per turn (any sequence: a tuple)
  # Its own structured output: "regex:PATTERN", "json_schema:SCHEMA", or a dict {"regex": PATTERN} /
  # {"json_schema": {...}} (docs/constraints.md); held as its spec string. "" or None: the call's (config.constraint).
  constraint: str = ""
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # copied into each output (e.g. category)
  source: str = dataclasses.field(default="", compare=False, repr=False)  # for errors: "request 2", "p.jsonl:3"
  # Its own budget of new tokens per turn, at most the call's config.max_new_tokens (the width the program
  # is compiled for: `check_budget`); None: the call's.
  max_new_tokens: int | None = None
  # Its own sampling knobs (as config's: 0 = greedy, 0 = no top-k, 1 = no top-p); None: the call's. Runtime
  # values: requests of any knobs share one program, which is greedy only when every row is and filters
  # when any row does.
  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    prompt = self.prompt
    if not isinstance(prompt, str):
      prompt = tuple(prompt) if isinstance(prompt, Sequence) else None
      if not (prompt and all(isinstance(turn, str) for turn in prompt)):
        raise ConfigError(f"{self.field('prompt')} must be a string or a non-empty list of strings (the turns), "
                          f"got {self.prompt!r:.60}")
    object.__setattr__(self, "prompt", prompt)
    object.__setattr__(self, "constraint", compiler.spec_of(self.constraint, self.field("constraint")))
    object.__setattr__(self, "meta", dict(self.meta))
    budget = self.max_new_tokens
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
      raise ConfigError(f"{self.field('max_new_tokens')} must be an integer >= 1 (or None: the call's), "
                        f"got {budget!r}")
    for name, value in zip(Knobs._fields, self._own_knobs()):
      error = "" if value is None else knob_error(name, value)
      if error:
        raise ConfigError(f"{self.field(name)} {error} (or None: the call's)")

  def _own_knobs(self) -> tuple:
    """(temperature, top_k, top_p) as given: None where it leaves the call's."""
    return self.temperature, self.top_k, self.top_p

  def own_settings(self) -> dict[str, Any]:
    """What it sets for itself instead of the call (budget, sampling knobs, constraint), as its outputs
    record it: a field it leaves to the call is absent."""
    own = dict(zip(("max_new_tokens", *Knobs._fields), (self.max_new_tokens, *self._own_knobs())))
    return {
        **{name: value for name, value in own.items() if value is not None},
        **({"constraint": self.constraint} if self.constraint else {})
    }

  def knobs(self, call: Knobs) -> Knobs:
    """Its sampling knobs in a call whose own (the config's) are `call`."""
    return Knobs(*(default if own is None else own for own, default in zip(self._own_knobs(), call)))

  def budget(self, call_budget: int) -> int:
    """Its new tokens per turn in a call whose budget (config.max_new_tokens) is `call_budget`."""
    return call_budget if self.max_new_tokens is None else self.max_new_tokens

  def check_budget(self, call_budget: int) -> None:
    """Its budget fits the call's (the program's output width and caches are compiled for that one)."""
    if self.budget(call_budget) > call_budget:
      raise ConfigError(f"{self.field('max_new_tokens')} {self.max_new_tokens} exceeds config.max_new_tokens "
                        f"{call_budget}, the most a call's program decodes: raise that instead")

  @property
  def turns(self) -> tuple[str, ...]:
    """The user's messages, one per turn (a plain prompt: one)."""
    return (self.prompt,) if isinstance(self.prompt, str) else self.prompt

  def field(self, name: str) -> str:
    """How errors name this request's field `name`."""
    return f"{name} of {self.source}" if self.source else name


def _read_file(path: str) -> list[Request]:
  """The requests of a prompts file. Errors name the file and the line (counting every line)."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"prompts file {path}: {getattr(e, 'strerror', None) or e}") from None
  numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
  if not numbered:
    raise ValueError(f"prompts file {path} holds no prompt")
  if not path.endswith(".jsonl"):
    return [Request(line) for _, line in numbered]
  requests = []
  for number, line in numbered:
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{number}: invalid JSON ({e.msg} at column {e.colno})") from None
    turns = record.get("turns") if isinstance(record, dict) else None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
      turns = [record["prompt"]]
    if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
      got = (f"a {type(record).__name__}"
             if not isinstance(record, dict) else f"a 'prompt' of type {type(record['prompt']).__name__}"
             if "prompt" in record else "a 'turns' that is not a non-empty list of strings"
             if "turns" in record else "neither a 'prompt' nor a 'turns' field")
      raise ValueError(f"{path}:{number}: expected a JSON object with a 'prompt' string or a 'turns' list of "
                       f"strings, got {got}")
    meta = {
        k: v
        for k, v in record.items()
        if k not in ("prompt", "turns", "constraint", *OWN_FIELDS) and isinstance(v, (str, int, float))
    }
    prompt = record["prompt"] if isinstance(record.get("prompt"), str) else tuple(turns)
    requests.append(
        Request(prompt, record.get("constraint"), meta, source=f"{path}:{number}",
                **{name: record.get(name) for name in OWN_FIELDS}))
  return requests


def _read_mt_bench(source: str) -> list[Request]:
  """The MT-Bench selection named by `source` ("mt-bench[?category=a,b&per_category=N]")."""
  query = urllib.parse.urlsplit(source).query
  options = urllib.parse.parse_qs(query, keep_blank_values=True, separator="&")
  unknown = sorted(set(options) - {"category", "per_category"})
  if unknown:
    raise ValueError(f"config.prompts_file {source!r}: unknown option {unknown[0]!r}; "
                     f"expected mt-bench?category=a,b&per_category=N")
  categories = [c for value in options.get("category", []) for c in value.split(",") if c]
  raw = options.get("per_category", ["0"])[-1]
  per_category = int(raw) if raw.strip().lstrip("-").isdigit() else None
  error = (mtbench.selection_error(categories, per_category)
           if per_category is not None else f"per_category must be an integer >= 0, got {raw!r}")
  if error:
    raise ValueError(f"config.prompts_file {source!r}: {error}")
  questions = mtbench.select(mtbench.read_questions(registry.installed_path(MT_BENCH)), categories, per_category)
  return [Request(q.turns, meta={"question_id": q.question_id, "category": q.category}) for q in questions]


def is_dataset(source: str) -> bool:
  return source == MT_BENCH or source.startswith(MT_BENCH + "?")


def requests(prompts: Sequence[str], prompts_file: str) -> list[Request]:
  """The requests of a decode config's `prompts` and `prompts_file` (which wins when set)."""
  if not prompts_file:
    return [Request(p) for p in prompts]
  return _read_mt_bench(prompts_file) if is_dataset(prompts_file) else _read_file(prompts_file)


def messages(conversation: Request, answers: Sequence[str]) -> list[dict[str, str]]:
  """The chat messages of the turn after `answers`: each user message answered, then the next one."""
  turn = len(answers)
  history = [
      m for user, answer in zip(conversation.turns, answers)
      for m in ({"role": "user", "content": user}, {"role": "assistant", "content": answer})
  ]
  return history + [{"role": "user", "content": conversation.turns[turn]}]


def turn_ids(tokenizer: Tokenizer, conversation: Request, answers: Sequence[str], chat: bool) -> list[int]:
  """The input ids of the turn after `answers` (the model's answers so far): through the chat template
  when `chat` (its special tokens are part of it), else the one prompt with the tokenizer's specials."""
  if not chat:
    if len(conversation.turns) > 1:
      raise ValueError("a multi-turn conversation needs config.chat (its turns are chat messages)")
    return tokenizer.encode(conversation.turns[0])
  return tokenizer.encode(tokenizer.apply_chat_template(messages(conversation, answers)), add_special_tokens=False)


def width_bound(tokenizer: Tokenizer, conversations_: Sequence[Request], chat: bool, max_new_tokens: int) -> int:
  """The most input ids any turn of `conversations_` can take: the longest conversation with empty
  answers, plus each earlier answer's budget and `ANSWER_SLACK` (its text re-encoded). One width for
  every turn keeps one compiled program for the whole run."""
  def bound(conversation: Request) -> int:
    earlier = len(conversation.turns) - 1
    if not earlier:
      return len(turn_ids(tokenizer, conversation, (), chat))
    empty = turn_ids(tokenizer, conversation, [""] * earlier, chat)
    return len(empty) + earlier * (max_new_tokens + ANSWER_SLACK)

  return max(bound(c) for c in conversations_)


def answer_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
  """A generated answer as the next turn's history holds it: special tokens dropped, stripped."""
  return tokenizer.decode(ids, skip_special_tokens=True).strip()


def encode(tokenizer: Tokenizer, texts: Sequence[str], chat: bool) -> list[list[int]]:
  """The input ids of one-turn prompts `texts` (`turn_ids` of each)."""
  return [turn_ids(tokenizer, Request(text), (), chat) for text in texts]
