import gc
import os
import shutil
import tempfile

import jax
import pytest
import torch

from specjax.speculative.k_policy import cost_store
from tests.helpers.xla_flags import FAST_COMPILE_FLAGS

jax.config.update("jax_numpy_rank_promotion", "raise")
# torch's reference forwards compete with XLA's threads for the 2 cores; one thread keeps them fast.
torch.set_num_threads(1)

# One persistent compilation cache per test run, shared by the xdist workers and every subprocess they
# start (CLIs, multi-device workers: they inherit the environment): a program compiled once is loaded,
# not compiled, wherever it recurs. A fresh directory per run keeps runs hermetic; the process that
# made it removes it at the end.
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_MADE_CACHE_ENV = "SPECJAX_TEST_MADE_COMPILE_CACHE"
# XLA CPU maps each executable's code into memory; past the kernel's 65,530 mappings per process
# (`vm.max_map_count`) XLA crashes (abort or segfault) in whichever test comes next. Compiled programs are
# kept across modules until a process holds this many mappings, then dropped (the persistent cache
# reloads them without compiling). At 40,000 the rare clears dropped so many programs at once that two
# module teardowns took 40 s and 20 s in a full run; at 30,000 none stands out.
_MAX_MAPPINGS = 30_000


def pytest_configure(config):
  if _CACHE_ENV not in os.environ:  # the first pytest process of the run (the xdist controller)
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="specjax-test-jax-cache-")
    os.environ[_MADE_CACHE_ENV] = os.environ[_CACHE_ENV]
    # The adaptive policy's stored cost tables: inside this run's directory, never the user's cache.
    os.environ[cost_store.DIRECTORY_ENV] = os.path.join(os.environ[_CACHE_ENV], "cost_tables")
    # Programs that took a second or more to compile are cached (subprocesses read these at import);
    # writing every small one too made a whole run ~13% slower (48 against 55 CPU-minutes).
    os.environ.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if os.environ.get("SPECJAX_REAL_MODEL_TESTS") != "1":  # tiny programs compile ~2.5x faster (`xla_flags`)
      os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()
  # This process imported jax before the environment was set: the same settings by hand.
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  if os.environ.get(_MADE_CACHE_ENV) == os.environ.get(_CACHE_ENV) and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ.pop(_MADE_CACHE_ENV), ignore_errors=True)


def _mappings() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux: no per-process mapping limit to watch
    return 0


@pytest.fixture(autouse=True)
def own_cost_tables(tmp_path, monkeypatch):
  """Each test stores and finds the adaptive policy's cost tables in a directory of its own (a table
  another test measured for the same program is not there), as do the CLIs it starts."""
  monkeypatch.setenv(cost_store.DIRECTORY_ENV, str(tmp_path / "cost_tables"))


@pytest.fixture(autouse=True, scope="module")
def free_compiled_programs():
  """Drops every compiled program after a test module once the process nears the mapping limit."""
  yield
  if _mappings() > _MAX_MAPPINGS:
    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
  """Modules holding a `slow` test run first (the xdist workers take whole files in this order:
  `--no-loadscope-reorder` in pyproject.toml keeps it, where xdist would re-sort the files by their number
  of tests), so that the last files to start are short ones and neither worker idles at the end."""
  slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.module.__name__ not in slow_modules)  # stable: file order kept
