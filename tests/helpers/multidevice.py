"""Running a worker script of the multi-device tests in its own process (it adds its own simulated
device count to the test run's XLA_FLAGS; the test process keeps one device) and reading the JSON
object it prints last."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.xla_flags import with_fusion_emitters


def run_worker(script: str, *args: str, timeout: float = 900, fusion_emitters: bool = False) -> dict:
  """`fusion_emitters`: with XLA's default emitters (`xla_flags.with_fusion_emitters`)."""
  env = dict(os.environ)
  if fusion_emitters:
    env["XLA_FLAGS"] = with_fusion_emitters(env.get("XLA_FLAGS", ""))
  done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), script), *args], capture_output=True,
                        text=True, timeout=timeout, env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])
