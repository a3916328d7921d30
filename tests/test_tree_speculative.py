"""Tree speculative decoding end to end (the model drafter drafting a static tree, the loop verifying it).

Greedy: the output equals the target's own greedy decoding token for token (ragged prompts, budgets that
are not multiples of the round, an EOS inside an accepted path, two tree shapes, drafts that agree
always, never or partly), and a chain-shaped tree behaves as plain K (same tokens, same acceptance).
Sampling: see test_tree_exactness.
"""

import jax
import numpy as np
import pytest

from specjax import metrics, testing
from specjax.generation import as_token_lists
from specjax.speculative.loop import SpeculativeLoop
from specjax.speculative.plan import RoundPlan
from specjax.speculative.trees import tree as tree_lib
from specjax.speculative.drafters.draft_head import restrict_head
from specjax.speculative.drafters.model import ModelDrafter
from tests.helpers.engine import (BUDGETS, CACHE_LEN, DRAFTS, GREEDY, PROMPTS, TARGET, run_speculative, target_greedy)
from tests.helpers.trees import TREES, run_tree_speculative


@pytest.mark.parametrize("tree_name", sorted(TREES))
def test_greedy_tree_decoding_equals_target_greedy(tree_name):
  tree = TREES[tree_name]
  for draft_name in ("same", "never", "perturbed", "independent"):
    out = run_tree_speculative(DRAFTS[draft_name], tree)
    assert as_token_lists(out.tokens, out.counts) == target_greedy(), draft_name
    np.testing.assert_array_equal(out.counts, BUDGETS)
    total = metrics.summarize(out.acceptance)["total"]
    if draft_name == "same":
      assert total["mean_accepted_length"] == tree.max_depth + 1


def test_a_restricted_draft_head_drafts_trees_inside_its_subset():
  """A draft scoring every other token id: greedy output stays the target's, and every drafted node
  (children are the head's top tokens) lies in the subset."""
  config, params = DRAFTS["perturbed"]
  head = restrict_head(config, params, range(0, config.vocab_size, 2))
  out = run_tree_speculative(DRAFTS["perturbed"], TREES["branching"], head=head)
  assert as_token_lists(out.tokens, out.counts) == target_greedy()
  assert metrics.summarize(out.acceptance)["total"]["accepted"] > 0
  drafter = ModelDrafter(config, params, head, tree=TREES["branching"])
  propose = jax.jit(
      lambda state, pending: drafter.propose(state, None, pending, GREEDY, jax.random.key(0), RoundPlan(3)))
  proposal, _, _ = propose(out.draft_state, jax.numpy.asarray([4, 6, 8]))  # op by op: ~50 s
  assert np.all(np.asarray(proposal.tokens) % 2 == 0)


def test_eos_inside_an_accepted_path_ends_the_row():
  expected = target_greedy()
  eos = expected[0][4]  # row 0's fifth token, inside a round of the "same" draft
  out = run_tree_speculative(DRAFTS["same"], TREES["branching"], eos_ids=[eos])
  got = as_token_lists(out.tokens, out.counts)
  for row, tokens in enumerate(expected):
    cut = tokens.index(eos) + 1 if eos in tokens else len(tokens)
    assert got[row] == tokens[:cut]


def test_chain_shaped_tree_equals_plain_k():
  chain = tree_lib.chain(3)
  as_tree = run_tree_speculative(DRAFTS["perturbed"], chain)
  plain = run_speculative(DRAFTS["perturbed"], k=3)
  np.testing.assert_array_equal(as_tree.tokens, plain.tokens)
  for name in ("rounds", "proposed", "accepted"):
    np.testing.assert_array_equal(getattr(as_tree.acceptance, name), getattr(plain.acceptance, name))


def test_bad_tree_runs_fail_on_the_host():
  tree = TREES["branching"]
  with pytest.raises(ValueError, match="needs 11 free positions per round, the target cache holds 8"):
    run_tree_speculative(DRAFTS["same"], tree, cache_len=8)
  with pytest.raises(ValueError, match="speculative generate"):  # prompt + budget + the tree's slack
    run_tree_speculative(DRAFTS["same"], tree, cache_len=36)
  config, params = DRAFTS["same"]
  drafter = ModelDrafter(config, params, tree=tree)
  with pytest.raises(ValueError, match="pass k = 3"):
    testing.speculate(SpeculativeLoop(TARGET[0], 2), TARGET[1], drafter, testing.request(PROMPTS, BUDGETS),
                      cache_len=CACHE_LEN)
  with pytest.raises(ValueError, match="tree_children"):
    ModelDrafter(config, params, tree=tree, tree_children="sorted").check(TARGET[0])
