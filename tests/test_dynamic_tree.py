"""Dynamic trees (EAGLE-2): the budget string, the per-row tables against the static trees', the drafted
tree against a reference built from plain causal forwards of every path, greedy decoding equal to the
target's, a one-child dynamic tree equal to the plain chain, and sampled exactness (chi-square)."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import metrics
from specjax.generation import as_token_lists, pad_prompts
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import forward, prefill
from specjax.speculative.trees import dynamic as dynamic_tree
from specjax.speculative.trees import tree as tree_lib
from specjax.speculative.trees.dynamic import DynamicSpec, DynamicTree, draft_dynamic_tree
from specjax.speculative.trees.acceptance import verify_tree
from tests.helpers import mutants
from tests.helpers.engine import (BUDGETS, DRAFTS, GREEDY, PROMPTS, SAMPLE_PROMPT, SMALL_DRAFT, SMALL_TARGET,
                                  run_speculative, target_greedy)
from tests.helpers.trees import (ALPHA, LONG_STEPS, REJECTED, ROWS, SAMPLED, STEPS, TREES, all_positions_pvalue,
                                 no_update_rule, run_tree_speculative, sampled_pvalue)

SPEC = DynamicSpec(nodes=6, depth=3, expand=2)  # 2 + 2 * 4 = 10 candidates, 6 kept


def test_parse_dynamic_budgets():
  assert tree_lib.parse("dynamic(16, 6, 4)") == DynamicSpec(16, 6, 4)
  assert tree_lib.parse(" dynamic(6,3,2) ").nodes_with_root == 7
  for spec, message in [("dynamic(16, 6)", r"dynamic\(N, D, b\)"), ("dynamic", r"dynamic\(N, D, b\)"),
                        ("dynamic(0, 2, 2)", "nodes must be an integer >= 1"),
                        ("dynamic(7, 2, 2)", "keeps 7 nodes of only 6 candidates")]:
    with pytest.raises(ValueError, match=message):
      tree_lib.parse(spec)


@pytest.mark.parametrize("tree_name", sorted(TREES))
def test_per_row_tables_equal_the_static_trees(tree_name):
  tree = TREES[tree_name]
  rows = lambda values: jnp.broadcast_to(jnp.asarray(values, jnp.int32), (2, tree.nodes_with_root))
  dynamic = DynamicTree(parent=rows(tree.parent), depth=rows(tree.depth), max_depth=tree.max_depth,
                        max_children=tree.children_table().shape[1])
  for name in ("ancestor_mask", "path_table", "children_table"):
    got = np.asarray(getattr(dynamic, name)())
    np.testing.assert_array_equal(got, np.broadcast_to(getattr(tree, name)(), got.shape), err_msg=name)


DEEP_SPEC = DynamicSpec(nodes=10, depth=4, expand=2)  # 2 + 3 * 4 = 14 candidates, 10 kept; 3 frontier chunks
PLAIN_WIDTH = 16  # every plain forward right-padded to this: one compiled program (causal: padding is unseen)
_plain_forward = jax.jit(forward, static_argnums=0)


def _reference_tree(config, params, history, spec):
  """EAGLE-2's selection by plain causal forwards of every path (no tree masks, no cache reuse):
  ({path tokens: cumulative log-probability} of the kept nodes, {path: log-probabilities [V] after it}
  of every expanded path, the root's () included)."""
  after = {}

  def logp_after(path):
    tokens = history + list(path)
    padded_1xT = jnp.asarray([tokens + [0] * (PLAIN_WIDTH - len(tokens))])
    logits = _plain_forward(config, params, padded_1xT, init_cache(config, 1, PLAIN_WIDTH))[0][0, len(tokens) - 1]
    after[path] = np.asarray(jax.nn.log_softmax(logits))
    return after[path]

  def children(path, score):
    logp = logp_after(path)
    top = np.argsort(-logp, kind="stable")[:spec.expand]
    return [(path + (int(t),), score + float(logp[t])) for t in top]

  level = children((), 0.0)
  candidates = list(level)
  for _ in range(spec.depth - 1):
    frontier = sorted(level, key=lambda c: -c[1])[:spec.expand]
    level = [child for path, score in frontier for child in children(path, score)]
    candidates += level
  kept = sorted(candidates, key=lambda c: -c[1])[:spec.nodes]
  return dict(kept), after


def _drafted_with_logits(config, params, spec, cache, logits_BxV):
  """`draft_dynamic_tree`'s tokens, trees and slots, and the draft's log-probabilities [B, Fr, V] at each
  fed slot (recorded by wrapping the score function it hands `grow_dynamic_tree`), as one compiled
  program, traced anew per call (seeing whatever is patched now)."""
  grow = dynamic_tree.grow_dynamic_tree

  def drafted(params, cache, logits_BxV):
    chunks = []

    def recording_grow(spec, root_logits_BxW, sampling, score_frontier, carry):
      def score(carry, *args):
        logits_BxbxV, carry = score_frontier(carry, *args)
        chunks.append(logits_BxbxV)
        return logits_BxbxV, carry

      return grow(spec, root_logits_BxW, sampling, score, carry)

    with mock.patch.object(dynamic_tree, "grow_dynamic_tree", recording_grow):
      tokens_BxN, tree, slots_BxN1, _ = draft_dynamic_tree(config, params, None, spec, cache, logits_BxV, GREEDY)
    return tokens_BxN, tree, slots_BxN1, jax.nn.log_softmax(jnp.concatenate(chunks, axis=1))

  tokens_BxN, tree, slots_BxN1, fed_logp_BxFrxV = jax.jit(drafted)(params, cache, logits_BxV)
  return tokens_BxN, tree, slots_BxN1, np.asarray(fed_logp_BxFrxV)


def test_drafted_tree_is_eagle2s_selection_from_plain_forwards(monkeypatch):
  """Frontier chunks (tree-masked, cached) give the same trees as plain forwards of every path, and each
  fed node's draft log-probabilities equal the plain forward's after its path (atol 1e-4), at depth 4:
  three frontier chunks, so a node of depth 3 has a fed grandparent. A frontier mask without it
  (mutants.NoGrandparentFrontier) moves the depth-3 nodes' log-probabilities by far more than that
  (asserted > 0.05; measured 3.8) while the trees still match the reference; at depth 3 (the
  root being history) it changed nothing."""
  config, params = DRAFTS["independent"]
  histories = [PROMPTS[0], PROMPTS[1][:5]]
  padded, lengths = pad_prompts(histories)
  logits_BxV, cache = prefill(config, params, padded, lengths, init_cache(config, 2, 32))
  wants = [_reference_tree(config, params, list(history), DEEP_SPEC) for history in histories]  # root: the last token

  def deviations(tokens_BxN, tree, slots_BxN1, fed_logp_BxFrxV, check_trees=True):
    """Checks the trees; returns {depth: the largest deviation of a fed node's log-probabilities there}."""
    paths, worst = np.asarray(tree.path_table()), {}
    for b, (kept, after) in enumerate(wants):
      path_of = lambda i: tuple(int(tokens_BxN[b, n - 1]) for n in paths[b, i, 1:int(tree.depth[b, i]) + 1])
      if check_trees:
        assert {path_of(i) for i in range(1, DEEP_SPEC.nodes_with_root)} == set(kept), b
        expanded = {int(p) for p in np.asarray(tree.parent[b, 1:])}
        assert all(int(slots_BxN1[b, i]) >= 0 for i in expanded - {0}) and int(slots_BxN1[b, 0]) == -1
      for i in range(1, DEEP_SPEC.nodes_with_root):
        if slots_BxN1[b, i] >= 0:
          error = float(np.abs(fed_logp_BxFrxV[b, int(slots_BxN1[b, i])] - after[path_of(i)]).max())
          worst[int(tree.depth[b, i])] = max(worst.get(int(tree.depth[b, i]), 0.0), error)
    return worst

  worst = deviations(*_drafted_with_logits(config, params, DEEP_SPEC, cache, logits_BxV))
  assert set(worst) == {1, 2, 3} and max(worst.values()) < 1e-4, worst
  # The mutant's fed nodes are the same (their scores come from correct levels), their logits are not.
  monkeypatch.setattr(dynamic_tree, "_Frontier", mutants.NoGrandparentFrontier)
  broken = deviations(*_drafted_with_logits(config, params, DEEP_SPEC, cache, logits_BxV), check_trees=False)
  assert max(broken[1], broken[2]) < 1e-4 and broken[3] > 0.05, broken


@pytest.mark.parametrize("draft_name", ["same", "perturbed", "independent"])
def test_greedy_dynamic_tree_decoding_equals_target_greedy(draft_name, monkeypatch):
  """With the draft "same" most rounds accept nodes of depth 2 and 3, whose target logits need the whole
  ancestor mask: a verify mask without the grandparent (mutants.no_grandparent_ancestor_mask) changes
  the output (also with "perturbed"; "independent" accepts too little to see it, and so does the sampled
  test below, whose 3 tokens never read a depth-2 node's logits)."""
  out = run_tree_speculative(DRAFTS[draft_name], SPEC)
  assert as_token_lists(out.tokens, out.counts) == target_greedy()
  np.testing.assert_array_equal(out.counts, BUDGETS)
  if draft_name == "same":  # the root's argmax has the best score of all candidates: always kept, accepted
    total = metrics.summarize(out.acceptance)["total"]
    assert total["accepted_at_position"][0] == total["rounds"] and total["mean_accepted_length"] > 2.5
    assert total["accepted_at_position"][1] >= total["rounds"] - 2 and total["accepted_at_position"][2] >= 2
    monkeypatch.setattr(DynamicTree, "ancestor_mask", mutants.no_grandparent_ancestor_mask)
    broken = run_tree_speculative(DRAFTS[draft_name], SPEC, tree_rule=lambda *args: verify_tree(*args))  # traced anew
    assert as_token_lists(broken.tokens, broken.counts) != target_greedy()


def test_one_child_dynamic_tree_is_the_plain_chain():
  """dynamic(K, K, 1) is a chain of the draft's argmaxes: the same tokens and acceptance as K, which
  also checks the lagging token and the slot compaction round after round."""
  as_tree = run_tree_speculative(DRAFTS["perturbed"], DynamicSpec(3, 3, 1))
  plain = run_speculative(DRAFTS["perturbed"], k=3)
  np.testing.assert_array_equal(as_tree.tokens, plain.tokens)
  for name in ("rounds", "proposed", "accepted"):
    np.testing.assert_array_equal(getattr(as_tree.acceptance, name), getattr(plain.acceptance, name))


@functools.cache
def _first_tokens(tree_rule=None, budget=LONG_STEPS):
  """Counts [V^STEPS] of the first STEPS tokens of ROWS rows through dynamic(3, 2, 2) with `budget` tokens each
  (a runtime value: the program is that of LONG_STEPS, whose first STEPS tokens these are, key for key), and
  the engine's output."""
  kwargs = {} if tree_rule is None else {"tree_rule": tree_rule}
  out = run_tree_speculative(SMALL_DRAFT, DynamicSpec(3, 2, 2), target=SMALL_TARGET, prompts=[SAMPLE_PROMPT] * ROWS,
                             budgets=budget, sampling=SAMPLED, cache_len=16, out_width=LONG_STEPS, **kwargs)
  vocab, tokens_ZxT = SMALL_TARGET[0].vocab_size, np.asarray(out.tokens)
  return np.bincount(np.ravel_multi_index(tokens_ZxT[:, :STEPS].T, [vocab] * STEPS), minlength=vocab**STEPS), out


@pytest.mark.slow
def test_sampled_dynamic_tree_decoding_follows_the_exact_target_distribution():
  """N = SAMPLE_ROWS rows of LONG_STEPS = 8 tokens through dynamic(3, 2, 2) (three rounds at least per row):
  chi-square of the first 3 tokens' joint and the all-positions test (`all_positions_pvalue`: each of
  the 8 positions against the exact conditional given the row's earlier tokens, PIT in 10 bins,
  Bonferroni), each at level 1e-3 / 2; a rule that forgets the rejected children fails the first
  (p < 1e-6; run for the STEPS tokens it reads, the same draws as in LONG_STEPS). Positions 3 on read
  the target's logits at depth-2 nodes (the bonus after a full-depth path): the verify mask without the
  grandparent (`mutants.no_grandparent_ancestor_mask`), invisible in the first 3 tokens, fails the
  all-positions test."""
  counts, out = _first_tokens()
  assert 0 < metrics.summarize(out.acceptance)["total"]["accepted"]
  assert (np.asarray(out.acceptance.rounds) >= 3).all()
  assert sampled_pvalue(counts) > ALPHA / 2
  combined, pvalues_T = all_positions_pvalue(out.tokens)
  assert combined > ALPHA / 2, pvalues_T
  assert sampled_pvalue(_first_tokens(no_update_rule, STEPS)[0]) < REJECTED
