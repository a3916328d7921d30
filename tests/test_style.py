"""The project's style, checked in CI: `ruff check` with the rules and line length of pyproject.toml's
[tool.ruff] (120 columns, no tabs or trailing whitespace, no unused imports) over every Python file."""

import os
import subprocess

from ruff.__main__ import find_ruff_bin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
  result = subprocess.run([find_ruff_bin(), "check", "--no-cache", "--output-format", "concise", ROOT], cwd=ROOT,
                          capture_output=True, text=True)
  assert result.returncode == 0, f"ruff check found problems:\n{result.stdout[-4000:]}{result.stderr[-2000:]}"
