"""Static trees: numbering, masks and tables from branching tuples and path lists; bad shapes fail."""

import numpy as np
import pytest

from specjax.speculative.k_policy import Adaptive, Candidate, KPolicy
from specjax.speculative.trees import tree as tree_lib


def test_branching_numbers_levels_in_parent_then_rank_order():
  tree = tree_lib.from_branching((2, 2))
  assert tree.parent == (-1, 0, 0, 1, 1, 2, 2)
  assert tree.depth == (0, 1, 1, 2, 2, 2, 2)
  assert tree.children(1) == (3, 4) and tree.max_depth == 2 and tree.nodes_with_root == 7
  assert tree == tree_lib.from_paths([[1, 1], [0], [1], [0, 0], [0, 1], [1, 0]])
  assert hash(tree) == hash(tree_lib.from_branching((2, 2)))


def test_chain_is_the_tree_of_ones():
  tree = tree_lib.chain(3)
  assert tree.is_chain and tree.parent == (-1, 0, 1, 2)
  np.testing.assert_array_equal(tree.ancestor_mask(), np.tril(np.ones((4, 4), bool)))
  assert not tree_lib.from_branching((2,)).is_chain


def test_a_cut_keeps_the_nodes_no_deeper_than_its_depth_and_their_numbers():
  paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
  tree = tree_lib.from_paths(paths)
  for depth in range(4):
    cut = tree.cut(depth)
    expected = tree_lib.from_paths([p for p in paths if len(p) <= depth]) if depth else tree_lib.Tree((-1,), (0,))
    assert cut == expected and cut.max_depth == depth
    assert cut.parent == tree.parent[:cut.nodes_with_root]  # a prefix: node i is node i of the whole tree
  assert tree.cut(5) == tree and tree.cut(0).nodes_with_root == 1 and tree.cut(0).is_chain


def test_the_spine_follows_first_children_and_the_policy_offers_it_below_each_cut():
  """Nodes: 1 [0], 2 [1], 3 [2], 4 [0, 0], 5 [0, 1], 6 [1, 0], 7 [0, 0, 0]; a tree whose first child is
  a leaf has a shorter spine than its depth; candidates come after those they cover."""
  tree = tree_lib.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
  assert tree.spine() == (0, 1, 4, 7) and tree.spine(2) == (0, 1, 4) and tree.spine(0) == (0,)
  assert tree.is_first_child == (True, True, False, False, True, False, True, True)
  short = tree_lib.from_paths([[0], [1], [1, 0]])
  assert short.spine() == (0, 1) and short.max_depth == 2
  policy = Adaptive()
  assert [c.label for c in policy.candidates(3, tree)] == ["0", "1 spine", "1", "2 spine", "2", "3 spine", "3"]
  assert [c.label for c in policy.candidates(2, short)] == ["0", "1 spine", "1", "2"]
  assert [c.nodes(tree) for c in policy.candidates(3, tree)] == [1, 2, 4, 3, 7, 4, 8]
  assert policy.candidates(3, tree_lib.chain(3)) == policy.candidates(3) and policy.rows(3, tree_lib.chain(3)) == 1
  assert KPolicy().candidates(3, tree) == (Candidate(3),) and policy.rows(3, tree) == 2
  candidates = policy.candidates(3, tree)
  for i, candidate in enumerate(candidates):  # covers: a superset of nodes, and never a later candidate
    for j, other in enumerate(candidates):
      nodes = set(tree.spine(candidate.length) if candidate.spine else range(candidate.nodes(tree)))
      others = set(tree.spine(other.length) if other.spine else range(other.nodes(tree)))
      assert candidate.covers(other) == (others <= nodes) and (j <= i or not candidate.covers(other))


def test_masks_and_tables():
  tree = tree_lib.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])  # nodes 1, 2, 3 (0,0), 4 (0,1), 5
  assert tree.parent == (-1, 0, 0, 1, 1, 3)
  mask = tree.ancestor_mask()
  np.testing.assert_array_equal(np.flatnonzero(mask[5]), [0, 1, 3, 5])
  np.testing.assert_array_equal(np.flatnonzero(mask[2]), [0, 2])
  np.testing.assert_array_equal(tree.path_table()[5], [0, 1, 3, 5])
  np.testing.assert_array_equal(tree.path_table()[2], [0, 2, 2, 2])
  np.testing.assert_array_equal(tree.children_table()[:2], [[1, 2], [3, 4]])
  np.testing.assert_array_equal(tree.children_table()[2], [-1, -1])


@pytest.mark.parametrize("paths, message", [([], "empty"), ([[0], []], "empty path"), ([[0], [1, 0]], "prefix"),
                                            ([[1]], "elder sibling"), ([[0], [-1]], "integer >= 0"),
                                            ([[0], [0]], "twice")])
def test_malformed_path_lists_fail(paths, message):
  with pytest.raises(ValueError, match=message):
    tree_lib.from_paths(paths)


@pytest.mark.parametrize("branching", [(), (2, 0), (1.5,)])
def test_bad_branching_fails(branching):
  with pytest.raises(ValueError, match="branching"):
    tree_lib.from_branching(branching)


def test_tree_larger_than_the_cache_fails():
  tree_lib.chain(3).check_fits(4)
  with pytest.raises(ValueError, match="needs 7 free positions"):
    tree_lib.from_branching((2, 2)).check_fits(6)


def test_parse_config_strings():
  assert tree_lib.parse("") is None and tree_lib.parse("  ") is None
  assert tree_lib.parse("(4,2,2,1)") == tree_lib.from_branching((4, 2, 2, 1))
  assert tree_lib.parse("3") == tree_lib.from_branching((3,))
  assert tree_lib.parse("[[0], [1], [0, 0]]") == tree_lib.from_paths([[0], [1], [0, 0]])
  for bad in ("(2,", "[0, 1]", "'abc'", "((0,), 1)"):
    with pytest.raises(ValueError, match="neither a branching tuple"):
      tree_lib.parse(bad)


@pytest.mark.parametrize("spec, printed", [("(2, 2, 1)", "(2, 2, 1)"), ("3", "(3,)"), ("(1,1,1,1)", "(1, 1, 1, 1)"),
                                           ("[[0], [1], [0, 0]]", "[[0], [1], [0, 0]]"),
                                           ("[[0], [0, 0], [0, 1]]", "(1, 2)"),
                                           ("[[0], [1], [1, 0]]", "[[0], [1], [1, 0]]")])
def test_a_tree_prints_as_a_config_string_that_names_it(spec, printed):
  """Messages name a tree as a user writes it (its branching tuple where it is a full tree), not its
  parent and depth tuples."""
  assert str(tree_lib.parse(spec)) == printed and tree_lib.parse(printed) == tree_lib.parse(spec)
