"""Dynamic trees (EAGLE-2): the budget string, the per-row tables against the static trees', the drafted
tree against a reference built from plain causal forwards of every path, greedy decoding equal to the
target's, a one-child dynamic tree equal to the plain chain, and sampled exactness (chi-square)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import metrics
from specjax.generation import as_token_lists, pad_prompts
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import forward, prefill
from specjax.speculative import tree as tree_lib
from specjax.speculative.dynamic_tree import DynamicSpec, DynamicTree, draft_dynamic_tree
from tests.helpers.engine import (BUDGETS, DRAFTS, GREEDY, PROMPTS, SAMPLE_PROMPT, SMALL_DRAFT, SMALL_TARGET,
                                  run_speculative, target_greedy)
from tests.helpers.trees import (ALPHA, REJECTED, ROWS, SAMPLED, STEPS, TREES, no_update_rule, run_tree_speculative,
                                 sampled_pvalue)

SPEC = DynamicSpec(nodes=6, depth=3, expand=2)  # 2 + 2 * 4 = 10 candidates, 6 kept


def test_parse_dynamic_budgets():
  assert tree_lib.parse("dynamic(16, 6, 4)") == DynamicSpec(16, 6, 4)
  assert tree_lib.parse(" dynamic(6,3,2) ").num_nodes == 7
  for spec, message in [("dynamic(16, 6)", r"dynamic\(N, D, b\)"), ("dynamic", r"dynamic\(N, D, b\)"),
                        ("dynamic(0, 2, 2)", "nodes must be an integer >= 1"),
                        ("dynamic(7, 2, 2)", "keeps 7 nodes of only 6 candidates")]:
    with pytest.raises(ValueError, match=message):
      tree_lib.parse(spec)


@pytest.mark.parametrize("tree_name", sorted(TREES))
def test_per_row_tables_equal_the_static_trees(tree_name):
  tree = TREES[tree_name]
  rows = lambda values: jnp.broadcast_to(jnp.asarray(values, jnp.int32), (2, tree.num_nodes))
  dynamic = DynamicTree(parent=rows(tree.parent), depth=rows(tree.depth), max_depth=tree.max_depth,
                        max_children=tree.children_table().shape[1])
  for name in ("ancestor_mask", "path_table", "children_table"):
    got = np.asarray(getattr(dynamic, name)())
    np.testing.assert_array_equal(got, np.broadcast_to(getattr(tree, name)(), got.shape), err_msg=name)


def _reference_tree(config, params, history, spec):
  """EAGLE-2's selection by plain causal forwards of every path (no tree masks, no cache reuse):
  {path tokens: cumulative log-probability} of the kept nodes."""
  def logp_after(path):
    logits = forward(config, params, jnp.asarray([history + list(path)]),
                     init_cache(config, 1, len(history) + spec.depth + 1))[0][0, -1]
    return np.asarray(jax.nn.log_softmax(logits))

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
  return dict(kept)


def test_drafted_tree_is_eagle2s_selection_from_plain_forwards():
  """Frontier chunks (tree-masked, cached) give the same trees as plain forwards of every path: a wrong
  frontier mask, position or slot changes the tokens or scores of the deeper levels."""
  config, params = DRAFTS["independent"]
  histories = [PROMPTS[0], PROMPTS[1][:5]]
  padded, lengths = pad_prompts(histories)
  logits_BxV, cache = prefill(config, params, padded, lengths, init_cache(config, 2, 32))
  tokens_BxN, tree, slots_BxN1, _ = draft_dynamic_tree(config, params, None, SPEC, cache, logits_BxV, GREEDY)
  paths = np.asarray(tree.path_table())
  for b, history in enumerate(histories):
    want = _reference_tree(config, params, list(history), SPEC)  # the root is the history's last token
    nodes = {tuple(int(tokens_BxN[b, n - 1]) for n in paths[b, i, 1:int(tree.depth[b, i]) + 1])
             for i in range(1, SPEC.num_nodes)}
    assert nodes == set(want), b
    expanded = {int(p) for p in np.asarray(tree.parent[b, 1:])}
    assert all(int(slots_BxN1[b, i]) >= 0 for i in expanded - {0}) and int(slots_BxN1[b, 0]) == -1


@pytest.mark.parametrize("draft_name", ["same", "perturbed", "independent"])
def test_greedy_dynamic_tree_decoding_equals_target_greedy(draft_name):
  out = run_tree_speculative(DRAFTS[draft_name], SPEC)
  assert as_token_lists(out.tokens, out.counts) == target_greedy()
  np.testing.assert_array_equal(out.counts, BUDGETS)
  if draft_name == "same":  # the root's argmax has the best score of all candidates: always kept, accepted
    total = metrics.summarize(out.acceptance)["total"]
    assert total["accepted_at_position"][0] == total["rounds"] and total["mean_accepted_length"] > 2.5


def test_one_child_dynamic_tree_is_the_plain_chain():
  """dynamic(K, K, 1) is a chain of the draft's argmaxes: the same tokens and acceptance as K, which
  also checks the lagging token and the slot compaction round after round."""
  as_tree = run_tree_speculative(DRAFTS["perturbed"], DynamicSpec(3, 3, 1))
  plain = run_speculative(DRAFTS["perturbed"], k=3)
  np.testing.assert_array_equal(as_tree.tokens, plain.tokens)
  for name in ("rounds", "proposed", "accepted"):
    np.testing.assert_array_equal(getattr(as_tree.acceptance, name), getattr(plain.acceptance, name))


@functools.cache
def _first_tokens(tree_rule=None):
  kwargs = {} if tree_rule is None else {"tree_rule": tree_rule}
  out = run_tree_speculative(SMALL_DRAFT, DynamicSpec(3, 2, 2), target=SMALL_TARGET,
                             prompts=[SAMPLE_PROMPT] * ROWS, budgets=STEPS, sampling=SAMPLED, cache_len=16,
                             out_width=STEPS, **kwargs)
  vocab = SMALL_TARGET[0].vocab_size
  return np.bincount(np.ravel_multi_index(np.asarray(out.tokens).T, [vocab] * STEPS),
                     minlength=vocab ** STEPS), out


def test_sampled_dynamic_tree_decoding_follows_the_exact_target_distribution():
  """30,000 rows, first 3 tokens, level 1e-3 (see test_tree_exactness); a rule that forgets the
  rejected children fails."""
  counts, out = _first_tokens()
  assert 0 < metrics.summarize(out.acceptance)["total"]["accepted"]
  assert sampled_pvalue(counts) > ALPHA
  assert sampled_pvalue(_first_tokens(no_update_rule)[0]) < REJECTED
