"""Prompt sets built from Python standard-library sources, for `experiments.benchmark_drafters` and the
sweep configs that decode code edits (`configs/sweeps/qwen_coder_ngram_trees.py`).

Two sets, both deterministic (the functions are named by qualified name, their text is
`inspect.getsource` of this interpreter's standard library, dedented) and both made of code the target
has seen many times:

Input-grounded code edits (`code_edit_prompts`, chat prompts). Each prompt holds a whole function and
asks for an edit whose answer is that function again with a local change, so most of the answer's
tokens already appear, in order, in the prompt: the regime where prompt lookup (the `ngram` drafter,
transformers' `prompt_lookup_num_tokens`) proposes long runs the target accepts. The edits touch one
line or a few tokens and leave the rest verbatim (type hints, renames, an extra check, an f-string, a
dropped docstring); the answer is asked for in full ("Return the complete updated function ..."). The
functions are 18-37 lines (140-250 tokens with the Qwen2.5 tokenizer; 200-310 with the instruction and
the chat template): long enough that a 128-token answer is mostly copying, short enough that the
prompt's prefill (counted in every system's tokens/s) stays a small share of the run. Functions and
edits, in order (a benchmark taking the first N prompts takes the first N here):

  inspect.cleandoc                         add type hints
  heapq._siftup                            rename the variables `childpos` and `rightpos`
  queue.Queue.get                          remove the docstring
  ast.get_docstring                        %-formatting -> f-string
  string.Template.substitute               rename the parameter `mapping`
  threading.Condition.wait_for             raise TypeError for a non-callable `predicate`
  copy.copy                                rename the variable `reductor`
  shutil.copymode                          add type hints
  json.encoder.py_encode_basestring_ascii  `str.format` calls -> f-strings
  statistics.median                        raise ValueError instead of StatisticsError

(Not taken: textwrap.dedent, 49 lines; shutil.copyfileobj, 12; os.* and posixpath.* are frozen modules
in CPython 3.11, without source for `inspect`.)

Raw code continuation (`continuation_prompts`, plain text, no chat template): the first `lines` lines
(signature, then docstring or code) of longer standard-library functions (43-79 lines), to be
continued as a completion model would. The target has memorized much of this code and so has a small
draft model of its family: the regime of high draft acceptance (alpha ~0.8 for the Qwen2.5-Coder
0.5B drafting the 1.5B). Functions, in order: textwrap.dedent, shutil.copyfile, heapq.nlargest,
difflib.get_close_matches, copy.deepcopy, urllib.parse.urljoin, tempfile._get_default_tempdir,
csv.Sniffer.has_header, fractions.Fraction.limit_denominator, shutil.get_terminal_size.

The texts are those of the running interpreter's standard library (the project's venv: CPython
3.11); another Python version may word some of these functions differently, so benchmark records keep
the prompts themselves.
"""

from __future__ import annotations

import importlib
import inspect
import textwrap

# (module:qualified name, edit instruction): each answer repeats the function with a local change.
CODE_EDITS = (
    ("inspect:cleandoc", "Add type hints to the parameters and the return value of this function."),
    ("heapq:_siftup", "Rename the variable `childpos` to `child` and `rightpos` to `right` in this function."),
    ("queue:Queue.get", "Remove the docstring from this method, keeping the code unchanged."),
    ("ast:get_docstring", "Replace the %-formatting in the TypeError message with an f-string."),
    ("string:Template.substitute", "Rename the parameter `mapping` to `values` throughout this method."),
    ("threading:Condition.wait_for", "Add a check at the start of this method that raises TypeError when "
     "`predicate` is not callable."),
    ("copy:copy", "Rename the variable `reductor` to `reduce_method` throughout this function."),
    ("shutil:copymode", "Add type hints to the parameters and the return value of this function."),
    ("json.encoder:py_encode_basestring_ascii", "Replace the `str.format` calls in this function with "
     "f-strings."),
    ("statistics:median", "Make this function raise ValueError instead of StatisticsError for empty data."),
)

# Long functions whose first lines are continued as plain text.
CONTINUATIONS = (
    "textwrap:dedent",
    "shutil:copyfile",
    "heapq:nlargest",
    "difflib:get_close_matches",
    "copy:deepcopy",
    "urllib.parse:urljoin",
    "tempfile:_get_default_tempdir",
    "csv:Sniffer.has_header",
    "fractions:Fraction.limit_denominator",
    "shutil:get_terminal_size",
)

EDIT_SUFFIX = "Return the complete updated function in one Python code block."


def source(qualified_name: str) -> str:
  """The dedented source of `module:attribute.path` (e.g. "queue:Queue.get") in this interpreter's
  standard library."""
  module_name, _, path = qualified_name.partition(":")
  obj = importlib.import_module(module_name)
  for attribute in path.split("."):
    obj = getattr(obj, attribute)
  return textwrap.dedent(inspect.getsource(obj))


def code_edit_prompts() -> list[str]:
  """The input-grounded edit requests of `CODE_EDITS`, in order: the instruction, then the function in a
  fenced Python block (chat prompts: the benchmark applies the chat template)."""
  return [f"{instruction} {EDIT_SUFFIX}\n\n```python\n{source(name)}```" for name, instruction in CODE_EDITS]


def continuation_prompts(lines: int = 8) -> list[str]:
  """The first `lines` lines of each function of `CONTINUATIONS`, newline-terminated, as raw text to
  continue (no chat template)."""
  if lines < 1:
    raise ValueError(f"continuation prompts need at least 1 line, got {lines}")
  return ["".join(source(name).splitlines(keepends=True)[:lines]) for name in CONTINUATIONS]
