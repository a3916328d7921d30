"""Exactness of tree speculative sampling end to end: the first eight generated tokens through the tree
(2, 1) (the prefill's token, then rounds of up to three, the bonus included after a full-depth path:
every row needs three rounds at least, so compaction of an accepted second branch and the tree masks at
depth 2 are exercised before later rounds read the cache) over SAMPLE_ROWS seeded rows follow the target's
exact distribution (enumerated over a vocabulary of 8, fixed keys) at temperature 0.8 with top-k 6, for
i.i.d. and top-b children. Statistics: chi-square on two marginals of the exact
joint of the first 5 tokens, tokens 0-3 (4,096 cells) and tokens 2-4 (512 cells); and every one of the 8
positions against the target's exact conditional given the row's earlier tokens
(`trees.all_positions_pvalue`: randomized PIT per position in 10 bins, Bonferroni over the positions):
each of the three at level 1e-3 / 3 (1e-3 for the three). A broken tree rule (q' not updated after a
rejection), patched in while the loop is traced, fails the first of these tests alone with top-b children
(p < 1e-6, on 4,000 rows of the 4 tokens it reads, the same draws as in 8); the bonus after a full-depth
path drawn from the last residual instead of the leaf's q fails the test with i.i.d. children
(`SPECJAX_TEST_MUTANT=bonus_from_residual`, `tests/helpers/mutant_plugin.py`;
the rule-level Monte Carlo of test_tree_acceptance runs every mutant against every children mode). At
15,000 rows the correct engine gave p = 0.05-0.67 and every broken rule p = 0 (underflow) in every
children mode; at 4,000 rows they still give p < 1e-30, and the bonus mutant fails at SAMPLE_ROWS too.
"""

import functools

import numpy as np
import pytest

from specjax import metrics
from specjax.speculative.trees import acceptance as tree_acceptance
from specjax.speculative.trees import tree as tree_lib
from tests.helpers.engine import SAMPLE_PROMPT, SMALL_DRAFT, SMALL_TARGET, exact_distribution
from tests.helpers.stats import SAMPLE_ROWS, chi_square_pvalue
from tests.helpers.trees import (ALPHA, LONG_STEPS, REJECTED, SAMPLED, all_positions_pvalue, no_update_rule,
                                 run_tree_speculative)

SAMPLED_TREE = tree_lib.from_branching((2, 1))
ROWS = SAMPLE_ROWS
MUTANT_ROWS = 4_000  # the broken rules give p < 1e-30 at this size already (p = 0 by underflow at 15,000)
DEEP_STEPS = 5  # the prefill's token, round one's up to 3 (bonus included), and round two's: the joint's
MARGINALS = ((0, 1, 2, 3), (2, 3, 4))  # the positions of each chi-square test


def _first_tokens(children, tree_rule=tree_acceptance.verify_tree, rows=ROWS, budget=LONG_STEPS):
  """The [rows, LONG_STEPS] first tokens of tree speculative sampling (`budget` of them generated: a runtime
  value, the program is LONG_STEPS', whose first tokens these are, key for key), and the engine's output."""
  out = run_tree_speculative(SMALL_DRAFT, SAMPLED_TREE, target=SMALL_TARGET, prompts=[SAMPLE_PROMPT] * rows,
                             budgets=budget, sampling=SAMPLED, children=children, cache_len=16, out_width=LONG_STEPS,
                             tree_rule=tree_rule)
  return np.asarray(out.tokens), out


@functools.cache
def _exact_joint():
  """The target's exact distribution of the first DEEP_STEPS tokens, [V] * DEEP_STEPS."""
  return exact_distribution(*SMALL_TARGET, SAMPLE_PROMPT, SAMPLED, DEEP_STEPS)


def _marginal_pvalue(tokens_ZxT, positions):
  """Chi-square p-value of the rows' tokens at `positions` against that marginal of the exact joint of the
  first DEEP_STEPS."""
  vocab = SMALL_TARGET[0].vocab_size
  others = tuple(i for i in range(DEEP_STEPS) if i not in positions)
  counts = np.bincount(np.ravel_multi_index(tokens_ZxT[:, positions].T, [vocab] * len(positions)),
                       minlength=vocab**len(positions))
  return chi_square_pvalue(counts, _exact_joint().sum(axis=others).ravel())


def _pvalues(tokens_ZxT):
  """The p-values of each of MARGINALS (`_marginal_pvalue`), then the all-positions p-value of every token
  (`all_positions_pvalue`)."""
  return [_marginal_pvalue(tokens_ZxT, positions) for positions in MARGINALS] + [all_positions_pvalue(tokens_ZxT)[0]]


@pytest.mark.slow
# Children drawn without replacement run end to end in test_eagle's sampled tree test (the same drafting and
# rule, with a mutant of their renormalisation it rejects); the rule-level Monte Carlo covers every mode.
@pytest.mark.parametrize("children", ["iid", "top"])
def test_sampled_tree_decoding_follows_the_exact_target_distribution(children):
  tokens_ZxT, out = _first_tokens(children)
  assert 0 < metrics.summarize(out.acceptance)["total"]["accepted"]
  assert (np.asarray(out.acceptance.rounds) >= 3).all()  # 8 tokens take three rounds at least
  assert min(_pvalues(tokens_ZxT)) > ALPHA / 3
  if children == "top":  # the rule is shared by all modes (each mode's mutants: test_tree_acceptance)
    first = MARGINALS[0]  # alone rejects it: the broken run generates only these tokens
    broken, _ = _first_tokens(children, no_update_rule, MUTANT_ROWS, budget=len(first))
    assert _marginal_pvalue(broken, first) < REJECTED
