import gc

import jax
import pytest
import torch

jax.config.update("jax_numpy_rank_promotion", "raise")
# torch's reference forwards compete with XLA's threads for the 2 cores; one thread keeps them fast.
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def free_compiled_programs():
  """Drops every compiled program after each test module. XLA CPU maps each executable's code into
  memory, and the whole suite's programs in one process exceeded the kernel's 65,530 mappings per
  process (`vm.max_map_count`): XLA then crashed (abort or segfault) in whichever test came next."""
  yield
  jax.clear_caches()
  gc.collect()
