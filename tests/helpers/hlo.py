"""Reading compiled programs: the ops that copy or transpose a whole KV cache."""

import re

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]")


def whole_cache_moves(hlo_text: str, cache_dims: tuple[int, ...]) -> list[str]:
  """The instructions of a compiled module (`Compiled.as_text()`) that copy or transpose an array with
  the cache's dims in any order (every layer's keys or values, in any layout): XLA names such ops, and
  the fusions around them, `copy` or `transpose`. An in-place cache update has none."""
  moves = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match and re.search(r"copy|transpose", match.group(1)) and match.group(2):
      if sorted(int(d) for d in match.group(2).split(",")) == sorted(cache_dims):
        moves.append(line.strip()[:160])
  return moves


def table_copies(hlo_text: str, dims: tuple[int, ...], dtype: str = "") -> list[str]:
  """The instructions of a compiled module that make an array with `dims` in any order (of `dtype`, when
  given: e.g. "f32", a bfloat16 table widened) other than by naming one (a parameter, a tuple's element, a
  layout bitcast): a whole table copied."""
  found = []
  for line in hlo_text.splitlines():
    match = re.match(r"^\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(", line)
    if (match and match.group(2) and sorted(int(d) for d in match.group(2).split(",")) == sorted(dims) and
        match.group(3) not in ("parameter", "get-tuple-element", "bitcast") and (not dtype or match.group(1) == dtype)):
      found.append(line.strip()[:160])
  return found
