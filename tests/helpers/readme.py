"""Code blocks and commands of the README and the manual (`docs/*.md`), so that tests run their examples
as a reader would copy them."""

from __future__ import annotations

import glob
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
DOCS = [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
EXPERIMENT_READMES = sorted(glob.glob(os.path.join(ROOT, "experiments", "**", "README.md"), recursive=True))


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def blocks(path: str, language: str) -> list[str]:
  """The ```LANGUAGE fenced blocks of the markdown file `path`."""
  return re.findall(rf"```{language}\n(.*?)```", _read(path), flags=re.S)


def python_block(containing: str) -> str:
  """The one ```python block of the README and docs/ that contains `containing`."""
  found = [block for path in DOCS for block in blocks(path, "python") if containing in block]
  assert len(found) == 1, f"{len(found)} python blocks of README.md and docs/ contain {containing!r}"
  return found[0]


def _split(command: str) -> list[list[str]]:
  """A shell line as its simple commands (split on `&&`, `;`, `|`), each a list of words, with leading
  `NAME=VALUE` assignments and wrappers (`srun ...`, `timeout N`, `nice -n N`) dropped and redirections
  cut off; a `--command="..."` argument (ssh-like launchers) is parsed as commands of its own."""
  words = shlex.split(command, comments=True)
  commands, current = [], []
  for word in [*words, "&&"]:
    if word in ("&&", ";", "|", "||", "&"):
      commands.append(current)
      current = []
    else:
      current.append(word)
  simple = []
  for words in commands:
    nested = [w.split("=", 1)[1] for w in words if w.startswith("--command=")]
    if nested:
      simple.extend(c for n in nested for c in _split(n))
      continue
    starts = [i for i, w in enumerate(words) if w in ("python", "python3", "pip", "PYTHONPATH=.")]
    if not starts:
      if words:
        simple.append(words)
      continue
    words = words[starts[0]:]
    words = [w for w in words if w != "PYTHONPATH=."]
    cut = [i for i, w in enumerate(words) if w[:1] in (">", "<") or w[:2] in ("2>", "1>")]
    simple.append(words[:cut[0]] if cut else words)
  return simple


def commands(path: str) -> list[tuple[str, list[str]]]:
  """Every command of the markdown file `path`: the lines of its ```bash blocks (a trailing `\\` joins the
  next line) and the inline code spans that start with `python -m` and set a `--config`; each as
  (the line as written, the words of one simple command)."""
  lines = []
  for block in blocks(path, "bash"):
    lines.extend(line for line in block.replace("\\\n", " ").splitlines() if line.strip())
  lines.extend(span for span in re.findall(r"`(python -m [^`]+)`",
                                           _read(path).replace("\n", " ")) if "--config=" in span)
  return [(line, words) for line in lines for words in _split(line) if words]
