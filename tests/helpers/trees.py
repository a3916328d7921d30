"""Tree speculative decoding on the tiny models of `engine`: two static trees, the runner drafting them
with the model drafter, and the sampled-exactness setup (first STEPS tokens of ROWS rows against the
small target's exact distribution) with a broken tree rule that the same test must reject."""

import functools
from unittest import mock

import numpy as np

from specjax import testing
from specjax.sampling import sampling_params
from specjax.speculative.k_policy import Tables
from specjax.speculative.loop import SpeculativeLoop
from specjax.speculative.trees import acceptance as tree_acceptance
from specjax.speculative.trees import tree as tree_lib
from specjax.speculative.drafters.model import ModelDrafter
from tests.helpers.engine import (BUDGETS, CACHE_LEN, GREEDY, NO_EOS, OUT_WIDTH, PROMPTS, SAMPLE_PROMPT, SMALL_TARGET,
                                  TARGET, exact_distribution, target_conditionals)
from tests.helpers.stats import SAMPLE_ROWS, chi_square_pvalue, pit_pvalues

TREES = {
    "branching": tree_lib.from_branching((2, 2, 1)), "paths": tree_lib.from_paths([[0], [1], [2], [0, 0], [0, 1],
                                                                                   [1, 0], [0, 0, 0]])
}


def run_tree_speculative(draft, tree, target=TARGET, prompts=PROMPTS, budgets=BUDGETS, eos_ids=NO_EOS, sampling=GREEDY,
                         children="iid", seed=0, cache_len=CACHE_LEN, out_width=OUT_WIDTH, head=None, max_lag=1,
                         tables=Tables(), **settings):
  """Speculative decoding of `prompts` by `target` with the model drafter `draft` drafting `tree`;
  `settings` are the loop's (`SpeculativeLoop`), `tables` the K policy's."""
  (target_config, target_params), (draft_config, draft_params) = target, draft
  drafter = ModelDrafter(draft_config, draft_params, head, tree=tree, tree_children=children, max_lag=max_lag)
  return testing.speculate(SpeculativeLoop(target_config, tree.max_depth, out_width,
                                           **settings), target_params, drafter,
                           testing.request(prompts, budgets, sampling, seed=seed, eos_ids=eos_ids), cache_len=cache_len,
                           tables=tables)


ROWS, ALPHA, REJECTED = SAMPLE_ROWS, 1e-3, 1e-6
SAMPLED = sampling_params(0.8, top_k=6)
STEPS = 3  # the prefill's token and the first round's two
# Tokens per row of the all-positions tests (`all_positions_pvalue`): with a tree of depth <= 3 (at most 4
# tokens a round) every row commits at least two rounds, most several.
LONG_STEPS = 8


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


def all_positions_pvalue(tokens_ZxT, model=SMALL_TARGET, prompt=SAMPLE_PROMPT, sampling=SAMPLED):
  """Whether every generated position follows `model`'s exact conditional distribution given the row's
  earlier tokens, over all T positions (`target_conditionals`: V = 8 enumerated at each position):
  per position, a chi-square test of the randomized probability integral transform of the Z rows' tokens
  in 10 equiprobable bins against uniform (9 degrees of freedom; `stats.pit_pvalues`), the T tests
  combined by Bonferroni: returns (min(1, T * the smallest p-value), the T p-values). A test at level a
  asserts the first > a; a token the target cannot emit gives 0. Unlike the joint chi-square of the
  first tokens, it sees every round's tokens, however deep."""
  tokens_ZxT = np.asarray(tokens_ZxT)
  pvalues_T = pit_pvalues(tokens_ZxT, target_conditionals(model, prompt, sampling, tokens_ZxT))
  return min(1.0, len(pvalues_T) * float(pvalues_T.min())), pvalues_T
