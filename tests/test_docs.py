"""Every command of README.md and docs/ works as written.

The tiny ones (the tiny pair of `tests.helpers.tiny_pair` under /tmp/specjax-tiny, `configs/tiny.py`,
`configs/distill_tiny.py`) run: the decodes in this process (one compiled program per distinct decode,
shared with the rest of the module), the distillation in one subprocess (its `--config` flag and
`specjax.decode`'s cannot both be defined in one process). The others need real weights and are checked
without running: the module exists, the config file and its variant load, every `--config.FIELD` they
set is a field of that config, every registry name they fetch is registered, every path they name
exists. The commands of experiments/ READMEs get the same checks. The python blocks compile (the
plug-in example runs in tests/test_api.py), links reach their files and headings, and the front page
stays a front page: small, undated, no test-suite timings anywhere."""

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import readme
from tests.helpers.cli import decode_in_process
from tests.helpers.tiny_pair import write_tiny_pair

TINY = "/tmp/specjax-tiny"
TINY_CONFIGS = ("configs/tiny.py", "configs/distill_tiny.py")
DOC_COMMANDS = [
    (os.path.relpath(path, readme.ROOT), line, words) for path in readme.DOCS for line, words in readme.commands(path)
]
EXPERIMENT_COMMANDS = [(os.path.relpath(path, readme.ROOT), line, words)
                       for path in readme.EXPERIMENT_READMES
                       for line, words in readme.commands(path)]


def _module(words: list[str]) -> str | None:
  return words[2] if len(words) > 2 and words[0] in ("python", "python3") and words[1] == "-m" else None


def _flags(words: list[str]) -> dict[str, str]:
  return dict(w[2:].split("=", 1) if "=" in w else (w[2:], "") for w in words if w.startswith("--"))


def _is_tiny(words: list[str]) -> bool:
  return _module(words) == "tests.helpers.tiny_pair" or _flags(words).get("config") in TINY_CONFIGS


def _load_config(spec: str):
  """The ConfigDict that `--config=PATH[:VARIANT]` names."""
  path, _, variant = spec.partition(":")
  assert os.path.isfile(os.path.join(readme.ROOT, path)), f"no config file {path}"
  module = importlib.import_module(path[:-len(".py")].replace("/", "."))
  return module.get_config(variant) if variant else module.get_config()


def _has_field(cfg, dotted: str) -> bool:
  node = cfg
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      return False
    node = node[part]
  return True


def check_without_running(where: str, words: list[str]) -> None:
  """The checks of a command that needs real weights (or a machine): see the module docstring."""
  module = _module(words)
  if words[0] == "pip" or words[:3] in (["python3", "-m", "pip"], ["python", "-m", "pip"]) or module is None:
    return  # installs and shell plumbing: nothing of specjax's to check
  assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
  arguments = words[3:]
  if module == "pytest":
    for path in (a.split("::")[0] for a in arguments if a.startswith("tests/")):
      assert os.path.exists(os.path.join(readme.ROOT, path)), f"{where}: no test file {path}"
  elif module == "specjax.models" and arguments[:1] == ["fetch"]:
    from specjax.models import registry
    for name in arguments[1:]:
      assert name in registry.MODELS, f"{where}: {name} is not a registered model"
  elif module == "specjax.data" and arguments[:1] == ["fetch"]:
    from specjax.data import registry
    for name in arguments[1:]:
      assert name in registry.DATASETS, f"{where}: {name} is not a registered data set"
  flags = _flags(arguments)
  if "config" not in flags:
    return
  cfg = _load_config(flags["config"])
  for field in (name[len("config."):] for name in flags if name.startswith("config.")):
    assert _has_field(cfg, field), f"{where}: {flags['config']} has no field {field!r}"
  for field, value in flags.items():  # files the command reads (outputs and work directories are made)
    if field.split(".")[-1] in ("draft", "target", "prompts_file", "source", "report") and "/" in value \
        and not value.startswith(("/", "DIR", "WORKDIR")) and "@" not in value \
        and not re.match(r"^\w+/[\w.-]+$", value):
      assert os.path.exists(os.path.join(readme.ROOT, value)), f"{where}: {value} does not exist"


@pytest.mark.parametrize("where, line, words", [c for c in DOC_COMMANDS if not _is_tiny(c[2])] + EXPERIMENT_COMMANDS,
                         ids=lambda x: x if isinstance(x, str) and len(x) < 60 else None)
def test_commands_that_need_real_weights_name_what_exists(where, line, words):
  check_without_running(f"{where}: {line}", words)


def test_the_docs_tiny_commands_run(tmp_path):
  tiny_commands = [(where, line, words) for where, line, words in DOC_COMMANDS if _is_tiny(words)]
  assert {where for where, _, _ in tiny_commands
         } >= {"docs/decoding.md", "docs/testing.md", "docs/distillation.md", "docs/writing-a-drafter.md"}
  root = str(tmp_path / "specjax-tiny")
  ran = set()
  for where, line, words in tiny_commands:
    words = [word.replace(TINY, root) for word in words]
    if tuple(words) in ran:
      continue
    ran.add(tuple(words))
    module, arguments = _module(words), words[3:]
    if module == "tests.helpers.tiny_pair":
      assert arguments == [root], line
      write_tiny_pair(root)
    elif module == "specjax.decode":
      status, stderr = decode_in_process(arguments)
      assert status == 0, f"{where}: {line}\n{stderr}"
    elif module == "specjax.distill":
      done = subprocess.run([sys.executable, "-m", module, *arguments], cwd=readme.ROOT, capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
      assert done.returncode == 0, f"{where}: {line}\n{done.stderr[-3000:]}"
      assert os.path.isfile(os.path.join(_flags(arguments)["config.workdir"], "export", "config.json"))
    else:
      raise AssertionError(f"{where}: no runner for the tiny command {line}")
  # docs/writing-a-drafter.md: the two output files hold the same tokens (greedy lookup = the target's own).
  outputs = [os.path.join(root, name) for name in ("ngram.json", "ar.json")]
  ngram, ar = ([o["token_ids"] for o in json.load(open(path))["outputs"]] for path in outputs)
  assert ngram == ar


@pytest.mark.parametrize("path", readme.DOCS, ids=lambda p: os.path.relpath(p, readme.ROOT))
def test_python_blocks_compile(path):
  for block in readme.blocks(path, "python"):
    compile(block, path, "exec")


def test_the_front_page_is_short_and_undated():
  text = open(readme.README).read()
  assert len(text.encode()) <= 15_000 and "2026-" not in text
  assert text.startswith("# specjax\n\n```bash\npip install -e . && python -m specjax.models fetch ")
  for link in re.findall(r"\]\(((?:docs|experiments)/[^)#]+)", text):
    assert os.path.exists(os.path.join(readme.ROOT, link)), link


def _anchor(heading: str) -> str:
  """GitHub's anchor of a markdown heading."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", readme.DOCS + readme.EXPERIMENT_READMES, ids=lambda p: os.path.relpath(p, readme.ROOT))
def test_links_reach_their_files_and_headings(path):
  for target in re.findall(r"\]\(([^)\s]+)\)", open(path).read()):
    if target.startswith(("http://", "https://")):
      continue
    file, _, anchor = target.partition("#")
    linked = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
    assert os.path.exists(linked), f"{os.path.relpath(path, readme.ROOT)}: {target}"
    if anchor:
      headings = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", open(linked).read(), flags=re.S), flags=re.M)
      assert anchor in {_anchor(h) for h in headings}, f"{os.path.relpath(path, readme.ROOT)}: {target}"


DURATION = re.compile(r"\b\d+(\.\d+)?\s*(s|sec|seconds|min|minutes|CPU-minutes|h|hours)\b")


@pytest.mark.parametrize("path", readme.DOCS + readme.EXPERIMENT_READMES, ids=lambda p: os.path.relpath(p, readme.ROOT))
def test_no_doc_times_the_test_suite(path):
  """The suite's timing history is kept by CI, not by the docs: no sentence about the suite or a test
  file's run states how long it took."""
  for sentence in re.split(r"(?<=[.!?])\s+|\n\n", open(path).read()):
    if re.search(r"\b(test suite|the suite|pytest|test file|tests/test_\w+\.py)\b", sentence):
      assert not DURATION.search(sentence), f"{os.path.relpath(path, readme.ROOT)}: {sentence!r}"
