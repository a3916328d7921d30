"""Random EAGLE (and DFlash) heads for the tiny targets and the runner that decodes with an EAGLE-fed drafter."""

import jax
import jax.numpy as jnp
import numpy as np

from specjax import testing
from specjax.models.kv_cache import init_cache
from specjax.speculative import verify
from specjax.speculative.drafters.eagle_head import MASK_PARAM, head_config, init_head_params
from specjax.speculative.k_policy import Tables
from specjax.speculative.loop import SpeculativeLoop, speculative_generate
from tests.helpers.engine import BUDGETS, CACHE_LEN, GREEDY, NO_EOS, OUT_WIDTH, PROMPTS


def eagle_head(target_config, feature_layers, seed=3, final_scale=1.0, mask=False):
  """A random head (numpy draws, std 0.3 on matrices, norms 1) for `target_config`; its final norm's
  scale `final_scale` (small: flat drafts, which a sampled target accepts more often); with `mask` a
  DFlash head (its mask embedding drawn like a matrix row)."""
  config = head_config(target_config, feature_layers)
  rng = np.random.default_rng(seed)
  init = lambda path, leaf: jnp.asarray(
      rng.normal(0.0, 0.3, leaf.shape)
      if leaf.ndim == 2 or path[0].key == MASK_PARAM else np.full(leaf.shape, final_scale
                                                                  if path[0].key == "final_norm" else 1.0), jnp.float32)
  shapes = jax.eval_shape(lambda: init_head_params(config, jax.random.key(0), mask))
  return config, jax.tree_util.tree_map_with_path(init, shapes)


def run_eagle(target, drafter, k, prompts=PROMPTS, budgets=BUDGETS, sampling=GREEDY, seed=0, rule=verify,
              out_width=OUT_WIDTH, cache_len=CACHE_LEN, eos_ids=NO_EOS, tables=Tables(), **settings):
  """Speculative decoding of `prompts` by `target` with the EAGLE drafter `drafter`, checked first as the
  engine's callers check it; `settings` are the loop's (`SpeculativeLoop`), `tables` the K policy's."""
  config, params = target
  drafter.check(config)
  request = testing.request(prompts, budgets, sampling, seed=seed, eos_ids=eos_ids)
  storage = drafter.storage(len(prompts), cache_len)
  drafter.check_fits(storage, np.asarray(request.prompt_lengths_B), max(np.atleast_1d(budgets)), k)
  return speculative_generate(SpeculativeLoop(config, k, out_width, rule=rule, **settings), params, drafter, request,
                              init_cache(config, len(prompts), cache_len), storage, tables)
