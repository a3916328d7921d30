"""Tree speculative decoding on the tiny models of `engine`: two static trees, the runner drafting them
with the model drafter, and the sampled-exactness setup (first STEPS tokens of ROWS rows against the
small target's exact distribution) with a broken tree rule that the same test must reject."""

import functools
from unittest import mock

import jax

from specjax.generation import pad_prompts
from specjax.models.kv_cache import init_cache
from specjax.sampling import sampling_params
from specjax.speculative.trees import acceptance as tree_acceptance
from specjax.speculative.trees import tree as tree_lib
from specjax.speculative.drafters.model import ModelDrafter
from tests.helpers.engine import (BUDGETS, CACHE_LEN, GREEDY, NO_EOS, OUT_WIDTH, PROMPTS, SAMPLE_PROMPT,
                                  SMALL_TARGET, TARGET, exact_distribution)
from tests.helpers.loop import speculate
from tests.helpers.stats import SAMPLE_ROWS, chi_square_pvalue

TREES = {"branching": tree_lib.from_branching((2, 2, 1)),
         "paths": tree_lib.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])}


def run_tree_speculative(draft, tree, target=TARGET, prompts=PROMPTS, budgets=BUDGETS, eos_ids=NO_EOS,
                         sampling=GREEDY, children="iid", seed=0, cache_len=CACHE_LEN, out_width=OUT_WIDTH,
                         head=None, max_lag=1, **kwargs):
  """Speculative decoding of `prompts` by `target` with the model drafter `draft` drafting `tree`."""
  (target_config, target_params), (draft_config, draft_params) = target, draft
  drafter = ModelDrafter(draft_config, draft_params, head, tree=tree, tree_children=children, max_lag=max_lag)
  padded, lengths = pad_prompts(prompts)
  return speculate(target_config, target_params, drafter, padded, lengths,
                   init_cache(target_config, len(prompts), cache_len),
                   drafter.storage(len(prompts), cache_len), budgets, eos_ids, sampling,
                   jax.random.key(seed), k=tree.max_depth, out_width=out_width, **kwargs)


ROWS, ALPHA, REJECTED = SAMPLE_ROWS, 1e-3, 1e-6
SAMPLED = sampling_params(0.8, top_k=6)
STEPS = 3  # the prefill's token and the first round's two


@functools.cache
def _exact():
  """The target's exact distribution of the first STEPS tokens, flattened."""
  return exact_distribution(*SMALL_TARGET, SAMPLE_PROMPT, SAMPLED, STEPS).ravel()


def sampled_pvalue(counts):
  """Chi-square p-value of counts [V^STEPS] of SMALL_TARGET's first STEPS tokens sampled with SAMPLED."""
  return chi_square_pvalue(counts, _exact())


def no_update_rule(*args):
  """A broken tree rule: q' is not updated after a rejection (patched while the loop is traced)."""
  with mock.patch.object(tree_acceptance, "residual", lambda q, p: q):
    return tree_acceptance.verify_tree(*args)
