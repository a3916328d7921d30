"""The n-gram (prompt lookup) drafter's test setup: two targets (the random one of `engine` and a
near-bigram variant whose greedy output falls into runs), prompts whose greedy continuations repeat
them, and the targets' free-running greedy tokens."""

import jax.numpy as jnp

from specjax import autoregressive, testing
from specjax.generation import as_token_lists
from specjax.models.kv_cache import init_cache
from tests.helpers.engine import NO_EOS, TARGET, tiny_model


def bigram(model):
  """The model with its attention output zeroed: its greedy next token is a function of the current
  token alone, so its greedy output enters a cycle (8 51 22 11 34 for `tiny_model(3)`) that prompt lookup
  predicts once it has been seen."""
  config, params = model
  layer = params["layers_0"]
  attn = dict(layer["attn"], o_proj={"weight": jnp.zeros_like(layer["attn"]["o_proj"]["weight"])})
  return config, dict(params, layers_0=dict(layer, attn=attn))


MODELS = {"random": TARGET, "cycling": bigram(tiny_model(3))}  # one config: one compile per K
PROMPTS = [[34, 8, 51, 22, 11, 60, 3, 34], [1, 2], [60, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]]
BUDGETS = [13, 6, 20]  # the longest prompt has the largest budget: the history is filled to the end
HISTORY_LEN = max(map(len, PROMPTS)) + max(BUDGETS) - 1  # the size `check_fits` demands, exactly
FREE_WIDTH = 32  # free-running greedy tokens: room for a budget of 20 and a block of K + 1 = 9 after it


def free_greedy(model):
  """The target's own greedy tokens, FREE_WIDTH per row, no EOS and no budget cut."""
  config, params = model
  out = autoregressive.generate(config, params, testing.request(PROMPTS, FREE_WIDTH, eos_ids=NO_EOS),
                                init_cache(config, len(PROMPTS), 48), out_width=FREE_WIDTH)
  return as_token_lists(out.tokens, out.counts)


# Holds every one of the 8 tokens: the pending one always matches, so every row's first round proposes.
SAMPLE_PROMPT = [3, 1, 4, 1, 5, 2, 6, 0, 7]
