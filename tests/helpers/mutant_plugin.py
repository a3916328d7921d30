"""A pytest plugin that runs a whole session on a deliberately broken copy of the code:

  SPECJAX_TEST_MUTANT=deeper_tree_cut python -m pytest -p tests.helpers.mutant_plugin -o addopts=-ra \\
      tests/test_k_policy.py

injects the mutant named (a key of `mutants.PLUGIN_MUTANTS`) before any test runs, for the session; the
tests that guard against it must fail. No test module imports this file: a normal run never sees it.
(Programs compiled by another process for the correct code are never reused: the persistent
compilation cache is keyed by the traced program, which the mutant changes.)"""

import os

import pytest

from tests.helpers import mutants

_PATCH = pytest.MonkeyPatch()


def pytest_configure(config):
  name = os.environ["SPECJAX_TEST_MUTANT"]
  mutants.PLUGIN_MUTANTS[name](_PATCH)
  print(f"mutant_plugin: {name} injected")


def pytest_unconfigure(config):
  _PATCH.undo()
