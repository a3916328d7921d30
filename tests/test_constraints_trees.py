"""Constrained decoding with draft trees: each node's mask is its own path's DFA state. Greedy output of
static and dynamic model-drafted trees and of n-gram spines equals the reference that masks the target
with the `regex` oracle token by token (rows under different constraints); a draft equal to the target,
masked node by node like it, is accepted whole; a dynamic tree's nodes all lie on allowed paths; a
lookup tree is cut at its deepest allowed node; at T = 1 the first tokens follow the masked,
renormalised target enumerated exactly, and fail when each node is masked by its parent's state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import regex

from specjax import decode_spec, testing
from specjax.constraints.mask import DEAD, Constrained
from specjax.decode_config import default_config
from specjax.generation import as_token_lists
from specjax.sampling import sampling_params
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.drafters.ngram import NgramDrafter
from specjax.speculative.k_policy import Tables
from specjax.speculative.loop import SpeculativeLoop
from specjax.speculative.proposal import Proposal
from specjax.speculative.trees import acceptance as tree_acceptance
from specjax.speculative.trees.dynamic import grow_dynamic_tree
from specjax.speculative.trees.tree import from_branching, parse
from tests.helpers import engine
from tests.helpers.constraints import (DIGITS_REGEX, EOS, OBJECT_REGEX, SMALL_REGEX, STRINGS_8, STRINGS_61,
                                       device_constraint, greedy_reference, small_pvalue)
from tests.helpers.k_policy import COSTS_K3, POLICY

PATTERNS = [OBJECT_REGEX, DIGITS_REGEX]  # rows 0 and 2 under the first, row 1 under the second
STATIC, DYNAMIC, SPINES = from_branching((2, 2, 1)), parse("dynamic(6, 3, 2)"), from_branching((2, 1, 1))


def _greedy(drafter, k=3, tables=Tables(), **settings):
  """(token lists, the output) of `drafter` on the engine's prompts greedy under PATTERNS; `settings` the
  loop's."""
  config, params = engine.TARGET
  sampling = sampling_params(0.0).replace(constraint=device_constraint(PATTERNS, STRINGS_61, len(engine.PROMPTS)))
  out = testing.speculate(SpeculativeLoop(config, k, engine.OUT_WIDTH, **settings), params, drafter,
                          testing.request(engine.PROMPTS, engine.BUDGETS, sampling, eos_ids=[EOS]),
                          cache_len=engine.CACHE_LEN, tables=tables)
  return as_token_lists(out.tokens, out.counts), out


@pytest.fixture(scope="module")
def greedy_expected():
  return [
      greedy_reference(engine.TARGET, [p], [b], PATTERNS[i % 2], STRINGS_61)[0]
      for i, (p, b) in enumerate(zip(engine.PROMPTS, engine.BUDGETS))
  ]


@pytest.mark.parametrize(
    "make",
    [  # a static tree: under the adaptive policy below, and drafted by the target
        lambda: ModelDrafter(*engine.DRAFTS["perturbed"], tree=DYNAMIC),
        lambda: NgramDrafter(vocab_size=engine.VOCAB, tree=SPINES)
    ],
    ids=["dynamic", "ngram_spines"])
def test_greedy_trees_equal_the_reference(make, greedy_expected):
  tokens, out = _greedy(make())
  assert tokens == greedy_expected
  assert any(row[-1] == EOS for row in tokens)  # a row finished its match


def test_greedy_tree_under_the_adaptive_policy_equals_the_reference(greedy_expected):
  """A static tree (2, 1) cut at the depth the policy chose, or only that cut's spine (a chain picked
  from the tree's nodes, its states along the chain): both kinds of round happen (a cut costs what its
  spine does), the output is the reference."""
  tree = from_branching((2, 1))
  candidates = POLICY.candidates(2, tree)
  tokens, out = _greedy(ModelDrafter(*engine.DRAFTS["perturbed"], tree=tree), k=2, policy=POLICY,
                        tables=Tables(COSTS_K3[[c.length for c in candidates]]))
  assert tokens == greedy_expected
  chosen = [c for c, n in zip(candidates, np.asarray(out.rounds_per_length)) if n and c.length]
  assert any(c.spine for c in chosen) and any(not c.spine for c in chosen)


def test_a_draft_equal_to_the_target_is_accepted_whole(greedy_expected):
  """Draft = target, both masked by each node's own state: the output is the reference and every round
  accepts the tree's first-choice path to its full depth (a draft node masked by another node's state,
  or not at all, would propose another token, which the cut or the target drops)."""
  tokens, out = _greedy(ModelDrafter(*engine.TARGET, tree=STATIC))
  assert tokens == greedy_expected
  np.testing.assert_array_equal(out.acceptance.accepted, STATIC.max_depth * out.acceptance.rounds)


def test_a_decode_config_may_constrain_a_tree():
  cfg = default_config()
  cfg.update(target="t.gguf", mode="speculative", drafter="ngram", tree="(2, 1, 1)", k=3, constraint="regex:a+")
  assert decode_spec.from_config(cfg).config.constraint == "regex:a+"  # no ConfigError


def test_a_lookup_tree_is_cut_at_its_deepest_allowed_node():
  """Spines (2, 1): under `SMALL_REGEX` from the start "ab" then "c" is allowed, "x" is not; a branch
  through "x" stays (the masked target never accepts it) but no longer makes the tree deeper."""
  constraint = device_constraint([SMALL_REGEX], STRINGS_8, 2)
  tree = from_branching((2, 1))  # nodes 1, 2 at depth 1; 3 (child of 1), 4 (child of 2) at depth 2
  point = Proposal(tokens=jnp.asarray([[4, 7, 3, 3], [7, 7, 3, 3]]), lengths=jnp.asarray([2, 2]), tree=tree)
  assert list(constraint.cut(point).lengths) == [2, 0]
  assert list(constraint.cut(point.replace(tokens=jnp.asarray([[7, 4, 3, 7], [4, 3, 7, 3]]))).lengths) == [1, 2]


# -- T = 1 on the 8-id model: the first SAMPLE_STEPS tokens against the exact constrained distribution -----
ROWS, ALPHA = 2_000, 1e-4  # the exact engine passes at ALPHA; the mutant scores 0 at 500 rows (off the support)
SAMPLED_TREE = from_branching((2, 1))  # i.i.d. children: the second token comes from a depth-1 node's q


def _sample(rows=ROWS, tree_rule=tree_acceptance.verify_tree):
  (config, params), (draft_config, draft_params) = engine.SMALL_TARGET, engine.SMALL_DRAFT
  drafter = ModelDrafter(draft_config, draft_params, tree=SAMPLED_TREE)
  sampling = sampling_params(1.0).replace(constraint=device_constraint([SMALL_REGEX], STRINGS_8, rows))
  request = testing.request([engine.SAMPLE_PROMPT] * rows, engine.SAMPLE_STEPS, sampling, seed=3, eos_ids=[EOS])
  loop = SpeculativeLoop(config, SAMPLED_TREE.max_depth, engine.SAMPLE_STEPS, tree_rule=tree_rule)
  out = testing.speculate(loop, params, drafter, request, cache_len=16)
  return np.asarray(out.tokens)


def test_sampled_tree_follows_the_constrained_target():
  tokens = _sample()
  assert small_pvalue(tokens) > ALPHA
  texts = {b"".join(STRINGS_8[t] for t in row if t != EOS).decode() for row in tokens}
  assert all(regex.fullmatch(SMALL_REGEX, text, partial=True) for text in texts)  # every row, T = 1


_along = Constrained.along


def _parents_state(self, tokens_BxN, tree=None):
  """`Constrained.along` for trees with each node given its parent's state (the root its own)."""
  states = _along(self, tokens_BxN, tree)
  if tree is None:
    return states
  parent_BxN1 = jnp.broadcast_to(jnp.maximum(jnp.asarray(tree.parent, jnp.int32), 0), states.state.shape)
  return states.replace(state=jnp.take_along_axis(states.state, parent_BxN1, axis=1))


def test_a_node_masked_by_its_parents_state_is_rejected(monkeypatch):
  """Nodes masked by their parent's state (the root's, for depth-1 nodes): the output leaves the
  constrained distribution. (A fresh `tree_rule` is a new static setting: the loop is traced with the patch.)"""
  monkeypatch.setattr(Constrained, "along", _parents_state)
  tokens = _sample(rows=500, tree_rule=lambda *args: tree_acceptance.verify_tree(*args))
  assert small_pvalue(tokens) < 1e-12


def test_dynamic_tree_nodes_are_drawn_under_their_own_paths_state():
  """`grow_dynamic_tree` on random logits that favour "x" (never allowed): under `SMALL_REGEX`, where
  every state allows at least two tokens, each of the tree's nodes lies on an allowed path (masked by its
  parent's path state, not the root's: after "a" only "a", "b" and "ab" may follow)."""
  rows, vocab = 64, len(STRINGS_8)
  constraint = device_constraint([SMALL_REGEX], STRINGS_8, rows)
  bias_1x1xW = jnp.zeros((1, 1, vocab)).at[..., 7].set(4.0)
  keys = iter(jax.random.split(jax.random.key(5), 8))

  def score_frontier(carry, chunk_Bxb, frontier, parent_slots_Bxb):
    return 3.0 * jax.random.normal(next(keys), (*chunk_Bxb.shape, vocab)) + bias_1x1xW, carry

  spec = parse("dynamic(6, 3, 2)")
  root_logits_BxW = 3.0 * jax.random.normal(next(keys), (rows, vocab)) + bias_1x1xW[0]
  grow = jax.jit(
      lambda root_logits_BxW, sampling: grow_dynamic_tree(spec, root_logits_BxW, sampling, score_frontier, None)[:2])
  tokens_BxN, tree = grow(root_logits_BxW, sampling_params(0.0).replace(constraint=constraint))
  assert bool(jnp.all(constraint.along(tokens_BxN, tree).state != DEAD))
