"""Exactness of tree speculative sampling end to end: the first three generated tokens (the prefill's and
the first round's two, through the tree (2, 1)) over 30,000 seeded rows follow the target's exact
distribution (enumerated over a vocabulary of 8; chi-square at level 1e-3, fixed keys) at temperature
0.8 with top-k 6, for i.i.d., without-replacement and top-b children; a broken tree rule (q' not
updated after a rejection, patched in while the loop is traced) fails the same test (p < 1e-6).
"""

import functools
from unittest import mock

import numpy as np
import pytest

from specjax import metrics
from specjax.sampling import sampling_params
from specjax.speculative import tree_acceptance
from specjax.speculative import tree as tree_lib
from tests.test_acceptance import chi_square_pvalue
from tests.test_speculative import SAMPLE_PROMPT, SMALL_DRAFT, SMALL_TARGET, _exact_distribution
from tests.test_tree_speculative import _tree_speculative

ROWS, ALPHA, REJECTED = 30_000, 1e-3, 1e-6
SAMPLED = sampling_params(0.8, top_k=6)
SAMPLED_TREE = tree_lib.from_branching((2, 1))
STEPS = 3  # the prefill's token and the first round's two


def _first_tokens(children, tree_rule=tree_acceptance.verify_tree):
  out = _tree_speculative(SMALL_DRAFT, SAMPLED_TREE, target=SMALL_TARGET, prompts=[SAMPLE_PROMPT] * ROWS,
                          budgets=STEPS, sampling=SAMPLED, children=children, cache_len=16, out_width=STEPS,
                          tree_rule=tree_rule)
  tokens = np.asarray(out.tokens)
  vocab = SMALL_TARGET[0].vocab_size
  counts = np.bincount(np.ravel_multi_index(tokens.T, [vocab] * STEPS), minlength=vocab ** STEPS)
  return counts, out


@functools.cache
def _exact():
  """The target's exact distribution of the first STEPS tokens, flattened."""
  return _exact_distribution(*SMALL_TARGET, SAMPLE_PROMPT, SAMPLED, STEPS).ravel()


def _pvalue(counts):
  return chi_square_pvalue(counts, _exact())


def _no_update_rule(*args):
  """A broken tree rule: q' is not updated after a rejection (patched while the loop is traced)."""
  with mock.patch.object(tree_acceptance, "residual", lambda q, p: q):
    return tree_acceptance.verify_tree(*args)


@pytest.mark.parametrize("children", ["iid", "without_replacement", "top"])
def test_sampled_tree_decoding_follows_the_exact_target_distribution(children):
  counts, out = _first_tokens(children)
  assert 0 < metrics.summarize(out.acceptance)["total"]["accepted"]
  assert _pvalue(counts) > ALPHA
  broken, _ = _first_tokens(children, _no_update_rule)
  assert _pvalue(broken) < REJECTED
