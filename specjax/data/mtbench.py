"""MT-Bench (Zheng et al. 2023): 80 questions in 8 categories of 10, each two user turns, the second
asking to revise or continue the model's own first answer. The file is FastChat's `question.jsonl`
(`python -m specjax.data fetch mt-bench`), one object per line:
{"question_id": int, "category": str, "turns": [first, second], ...}."""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


@dataclasses.dataclass(frozen=True)
class Question:
  question_id: int
  category: str
  turns: tuple[str, ...]  # the user's messages, in order


def read_questions(path: str) -> list[Question]:
  """Every question of an MT-Bench-style JSONL file, in file order; a malformed line fails naming
  the file and the line."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  questions = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      turns = record["turns"]
      if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
        raise ValueError("'turns' is not a non-empty list of strings")
      questions.append(Question(int(record["question_id"]), str(record["category"]), tuple(turns)))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
      raise ValueError(f"{path}:{number}: not an MT-Bench question ({type(e).__name__}: {e})") from None
  return questions


def selection_error(categories: Sequence[str], per_category: int) -> str | None:
  """Why (`categories`, `per_category`) selects nothing valid, or None."""
  unknown = [c for c in categories if c not in CATEGORIES]
  if unknown:
    return (f"unknown MT-Bench categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
            f"known: {', '.join(CATEGORIES)}")
  if per_category < 0:
    return f"per_category must be >= 0, got {per_category}"
  return None


def select(questions: Sequence[Question], categories: Sequence[str] = (), per_category: int = 0) -> list[Question]:
  """The first `per_category` questions (0 = all) of each of `categories` (empty = every category, in
  `CATEGORIES` order), grouped by category in that order, each category's in file order."""
  error = selection_error(categories, per_category)
  if error:
    raise ValueError(error)
  chosen = []
  for category in categories or CATEGORIES:
    of_category = [q for q in questions if q.category == category]
    chosen += of_category[:per_category] if per_category else of_category
  return chosen
