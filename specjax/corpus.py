"""Text corpora as documents: a directory or glob of files, the Python standard library's own sources
("stdlib"), a text file split at blank lines, or a JSONL field. Shared by distillation (training data)
and the frequency-ranked draft vocabulary (token counts)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sysconfig

STDLIB = "stdlib"  # source name for the `*.py` files of `sysconfig.get_paths()["stdlib"]`


@dataclasses.dataclass(frozen=True)
class Document:
  name: str  # where it came from: a file path, "path:line" (JSONL) or "path#paragraph" (text file)
  text: str


def _stdlib_files() -> list[str]:
  root = sysconfig.get_paths()["stdlib"]
  files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
  return [f for f in files if not {"site-packages", "dist-packages"} & set(f.split(os.sep))]


def _read_text(path: str) -> str | None:
  """The file's text, or None for a file that is not UTF-8 (a few test fixtures in the stdlib)."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except UnicodeDecodeError:
    return None


def read_documents(source: str, pattern: str = "**/*.py", jsonl_field: str = "text") -> list[Document]:
  """Non-empty documents of `source`, sorted by name.

  `source` is "stdlib", a directory (files matching `pattern` below it), a glob, a `.jsonl` file (the
  string field `jsonl_field` of every record) or a text file (paragraphs separated by blank lines).
  """
  if source == STDLIB:
    files = _stdlib_files()
  elif os.path.isdir(source):
    files = glob.glob(os.path.join(source, pattern), recursive=True)
  elif os.path.isfile(source) and source.endswith(".jsonl"):
    return _jsonl_documents(source, jsonl_field)
  elif os.path.isfile(source):
    with open(source, encoding="utf-8") as f:
      paragraphs = f.read().split("\n\n")
    docs = [Document(f"{source}#{i}", p) for i, p in enumerate(paragraphs) if p.strip()]
    return _nonempty(docs, source)
  else:
    files = glob.glob(source, recursive=True)
  docs = [
      Document(f, text) for f in sorted(files) if os.path.isfile(f)
      if (text := _read_text(f)) is not None and text.strip()
  ]
  return _nonempty(docs, f"{source} (pattern {pattern!r})" if os.path.isdir(source) else source)


def _jsonl_documents(path: str, field: str) -> list[Document]:
  docs = []
  with open(path, encoding="utf-8") as f:
    for line_number, line in enumerate(f, 1):
      if not line.strip():
        continue
      record = json.loads(line)
      if not isinstance(record.get(field), str):
        raise ValueError(f"{path}:{line_number}: record has no string field {field!r}")
      if record[field].strip():
        docs.append(Document(f"{path}:{line_number}", record[field]))
  return _nonempty(docs, path)


def _nonempty(docs: list[Document], source: str) -> list[Document]:
  if not docs:
    raise ValueError(f"no non-empty documents found in data source {source!r}")
  return docs
