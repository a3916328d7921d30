"""The KV cache is updated in place: no compiled decode program copies or transposes a whole cache (nor
widens a whole bfloat16 embedding, last test).

A copy of every layer's keys and values per layer and pass cost more than the model's own weights at
S_max = 2048 on CPU (a 28-layer step took 4-6x as long). Two ways it happened, each caught here: a
`fori_loop` (the live-length attention) closing over the stacked cache, which XLA then copies before
each layer's loop because the next write would clobber it; and a write vmapped over the rows, which
transposes the whole cache twice per layer at B > 1; and a `lax.cond`/`lax.switch` whose branches write
the cache (the verify widths, the draft's catch-up pass), which XLA copies on entry or exit of every
branch (`specjax.inplace`). Programs, at B = 2: autoregressive decoding, dense and blockwise, and the
speculative loop of every drafter kind (chains, trees, the adaptive policy's width switch).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from specjax import autoregressive, testing
from specjax.models import matmul
from specjax.models.kv_cache import init_cache
from specjax.speculative.drafters.eagle import EagleDrafter
from specjax.speculative.drafters.layer_skip import LayerSkipDrafter
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.k_policy import Adaptive, KPolicy
from specjax.speculative.loop import SpeculativeLoop
from specjax.speculative.trees.dynamic import DynamicSpec
from tests.helpers.eagle import eagle_head
from tests.helpers.engine import tiny_model
from tests.helpers.hlo import table_copies, whole_cache_moves
from tests.helpers.trees import TREES

CACHE_LEN = 40
# Two rows: every fault shows at B = 2 (a closed-over loop or a branch at any B, a vmapped write only at B > 1).
PROMPTS = [[5, 17, 3], [1, 2, 9, 4]]
BATCH = len(PROMPTS)
TARGET = tiny_model(0, n_layers=3)
DRAFT = tiny_model(1, n_layers=2)
EAGLE_BLOCK = eagle_head(TARGET[0], ())[0].block  # the EAGLE head's one-layer cache


def _with_block(model, block):
  config, params = model
  return dataclasses.replace(config, attention_block=block), params


def _cache_dims(config):
  return (config.n_layers, BATCH, CACHE_LEN, config.n_kv_heads, config.head_dim)


@pytest.mark.parametrize("block", [0, 16])
def test_autoregressive_program_moves_no_whole_cache(block):
  config, params = _with_block(TARGET, block)
  lowered = autoregressive.generate(config, params, testing.request(PROMPTS, 4), init_cache(config, BATCH, CACHE_LEN),
                                    lower=True)
  assert whole_cache_moves(lowered.compile().as_text(), _cache_dims(config)) == []


def _drafters(target_config, target_params, draft_config, draft_params):
  """name -> (drafter, K, policy): every drafter kind with a cache of its own or the target's (a history
  drafter's buffer is no cache; its verify-width switch is the adaptive policy's, which every `_adaptive`
  program has); the adaptive policy branches between verify widths as early stopping does, the model
  drafter between its catch-up passes at any policy, and a tree cut's compaction is the fixed tree's."""
  return {
      "model_adaptive": (ModelDrafter(draft_config, draft_params, None), 5, Adaptive()),
      "model_tree_adaptive": (ModelDrafter(draft_config, draft_params, None,
                                           tree=TREES["branching"]), TREES["branching"].max_depth, Adaptive()),
      "model_dynamic_tree": (ModelDrafter(draft_config, draft_params, None, tree=DynamicSpec(6, 3, 2)), 3, KPolicy()),
      "layer_skip_adaptive": (LayerSkipDrafter(target_config, target_params, (0,)), 4, Adaptive()),
      "eagle_adaptive": (EagleDrafter(*eagle_head(target_config, ()), target_config, target_params), 4, Adaptive()),
  }


@pytest.mark.parametrize("name", [
    "model_adaptive", "model_tree_adaptive", "model_dynamic_tree", "layer_skip_adaptive", "eagle_adaptive"
])
def test_speculative_program_moves_no_whole_cache(name):
  """Verify, draft, catch-up and compaction update both caches in place, whatever the round branches on
  (a `lax.cond`/`lax.switch` whose branches write a cache copies it: `specjax.inplace`)."""
  (target_config, target_params), (draft_config, draft_params) = _with_block(TARGET, 16), _with_block(DRAFT, 16)
  drafter, k, policy = _drafters(target_config, target_params, draft_config, draft_params)[name]
  lowered = testing.speculate(SpeculativeLoop(target_config, k, policy=policy), target_params, drafter,
                              testing.request(PROMPTS, 6), cache_len=CACHE_LEN, lower=True)
  compiled = lowered.compile().as_text()
  for config in (target_config, draft_config, EAGLE_BLOCK):
    assert whole_cache_moves(compiled, _cache_dims(config)) == []


def _bfloat16(model, backend):
  config, params = model
  return dataclasses.replace(config, dtype="bfloat16",
                             matmul=backend), jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)


@pytest.mark.skipif(matmul._library()[0] is None, reason="the CPU kernel library is not built")
def test_a_bfloat16_program_never_copies_its_embedding():
  """XLA:CPU widened a bfloat16 embedding to float32 around the token gather and hoisted that out of the
  loops: every call of the real pair's programs copied both embeddings whole (151936 x 1536 and x 896:
  ~0.3 s a call) to read a few rows. `transformer.take_rows`: through the CPU kernel the rows are copied
  by it, and no op of the speculative program (both embeddings, the prefill, the rounds and the deferred
  catch-up) makes a table-sized array; on XLA (the autoregressive program here) the table's bits are
  gathered, never widened to float32."""
  (target_config, target_params), (draft_config, draft_params) = (_bfloat16(TARGET, "cpu_kernel"),
                                                                  _bfloat16(DRAFT, "cpu_kernel"))
  drafter = ModelDrafter(draft_config, draft_params, None, max_lag=None)
  lowered = testing.speculate(SpeculativeLoop(target_config, 3, policy=Adaptive()), target_params, drafter,
                              testing.request(PROMPTS, 6), cache_len=CACHE_LEN, lower=True)
  for config in (target_config, draft_config):
    assert table_copies(lowered.compile().as_text(), (config.vocab_size, config.d_model)) == []
  config, params = _bfloat16(TARGET, "xla")
  lowered = autoregressive.generate(config, params, testing.request(PROMPTS, 4), init_cache(config, BATCH, CACHE_LEN),
                                    lower=True)
  assert table_copies(lowered.compile().as_text(), (config.vocab_size, config.d_model), "f32") == []
