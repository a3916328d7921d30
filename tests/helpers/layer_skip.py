"""Three-layer tiny targets, for the drafters that draft from a subset of the target's layers or from its
features (layer skip, EAGLE), and TARGET's own greedy decoding."""

import jax

from specjax.generation import as_token_lists, pad_prompts
from specjax.models.kv_cache import init_cache
from tests.helpers.engine import BUDGETS, CACHE_LEN, GREEDY, NO_EOS, OUT_WIDTH, PROMPTS, tiny_model
from tests.helpers.loop import autoregress

TARGET = tiny_model(0, n_layers=3)
SMALL_TARGET = tiny_model(10, vocab=8, n_layers=3, scale=0.5)


def target_greedy_3(prompts=PROMPTS, budgets=BUDGETS, eos_ids=NO_EOS):
  """The three-layer TARGET's own greedy decoding of `prompts`, as token lists."""
  config, params = TARGET
  padded, lengths = pad_prompts(prompts)
  out = autoregress(config, params, padded, lengths, init_cache(config, len(prompts), CACHE_LEN),
                    budgets, eos_ids, GREEDY, jax.random.key(0), out_width=OUT_WIDTH)
  return as_token_lists(out.tokens, out.counts)
