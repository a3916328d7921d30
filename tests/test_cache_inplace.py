"""The KV cache is updated in place: no compiled decode program copies or transposes a whole cache.

A copy of every layer's keys and values per layer and pass cost more than the model's own weights at
S_max = 2048 on CPU (a 28-layer step took 4-6x as long). Two ways it happened, each caught here: a
`fori_loop` (the live-length attention) closing over the stacked cache, which XLA then copies before
each layer's loop because the next write would clobber it; and a write vmapped over the rows, which
transposes the whole cache twice per layer at B > 1. Programs: autoregressive decoding and a
speculative loop with a static tree (writes, verify, `compact`), at B = 1 and 2, dense and blockwise.
"""

import dataclasses

import jax
import pytest

from specjax import autoregressive
from specjax.generation import pad_prompts
from specjax.models.kv_cache import init_cache
from specjax.speculative import speculative_generate
from specjax.speculative.drafters.model import ModelDrafter
from tests.helpers.engine import GREEDY, NO_EOS, tiny_model
from tests.helpers.hlo import whole_cache_moves
from tests.helpers.trees import TREES

CACHE_LEN = 40
TARGET = tiny_model(0, n_layers=3)
DRAFT = tiny_model(1, n_layers=2)


def _with_block(model, block):
  config, params = model
  return dataclasses.replace(config, attention_block=block), params


def _cache_dims(config, batch):
  return (config.n_layers, batch, CACHE_LEN, config.n_kv_heads, config.head_dim)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("block", [0, 16])
def test_autoregressive_program_moves_no_whole_cache(batch, block):
  config, params = _with_block(TARGET, block)
  padded, lengths = pad_prompts([[5, 17, 3], [1, 2, 9, 4]][:batch])
  lowered = autoregressive.generate(config, params, padded, lengths, init_cache(config, batch, CACHE_LEN), 4,
                                    NO_EOS, GREEDY, jax.random.key(0), lower=True)
  assert whole_cache_moves(lowered.compile().as_text(), _cache_dims(config, batch)) == []


@pytest.mark.parametrize("batch", [1, 2])
def test_tree_speculative_program_moves_no_whole_cache(batch):
  (target_config, target_params), (draft_config, draft_params) = _with_block(TARGET, 16), _with_block(DRAFT, 16)
  tree = TREES["branching"]
  drafter = ModelDrafter(draft_config, draft_params, None, tree=tree)
  padded, lengths = pad_prompts([[5, 17, 3], [1, 2, 9, 4]][:batch])
  lowered = speculative_generate(target_config, target_params, drafter, padded, lengths,
                                 init_cache(target_config, batch, CACHE_LEN), drafter.storage(batch, CACHE_LEN), 6,
                                 NO_EOS, GREEDY, jax.random.key(0), k=tree.max_depth, lower=True)
  compiled = lowered.compile().as_text()
  for config in (target_config, draft_config):
    assert whole_cache_moves(compiled, _cache_dims(config, batch)) == []
