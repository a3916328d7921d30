"""Deliberately broken acceptance rules and tree drafters (mutants), for the tests to show they have power.

Each mutant is one plausible bug of `acceptance` / `tree_acceptance` (or of the tree drafting feeding
them: `WITHOUT_REPLACEMENT_MUTANTS`, `no_grandparent_ancestor_mask`, `NoGrandparentFrontier`), injected
with pytest's `monkeypatch` (the patch is seen by a program traced while it is in place: wrap the rule
in a fresh function before `jax.jit`, or pass a fresh rule to the engine, which makes it trace anew):

- `same_key_for_every_row`: every row keyed by the same key (`jax.random.fold_in` patched to ignore the row):
  each row's marginal stays exact, the rows are correlated.
- `RESIDUAL_MUTANTS`: the residual after a rejection as `q` (never updated), `max(0, q - p)` not
  renormalised (invisible to `sample`, which normalises, so only the tree rule, whose next sibling reads
  q', can be broken by it) and `norm(max(0, p - q))` (the wrong way round).
- `chain_row(mutant)` / `tree_row(mutant)`: copies of `acceptance._verify_row` /
  `tree_acceptance._verify_tree_row` with one bug: "inverse_ratio" (accept with probability
  min(1, p/q)), "bonus_from_residual" (tree: after a path accepted to full depth the next token comes
  from the last residual q', not the leaf's q), "shared_sibling_uniform" (tree: the siblings of a level
  share one uniform), "later_sibling_kept" (tree: a rejected sibling of rank >= 1 leaves q' as it was:
  its point mass, or p, is not taken out of the residual; rank 0's rejection still is). The copies
  mirror the library's code as of this writing, mutation aside.
- `WITHOUT_REPLACEMENT_MUTANTS`: `tree_drafting._without_elders` (the distribution a child drawn without
  replacement was drawn from) with its elder siblings' tokens not removed, or removed but not
  renormalised. In a node's second child the two give the same output (the rule reads p there only at
  tokens other than the elder's, and q' is 0 at a rejected elder's token).
- `no_grandparent_ancestor_mask`: `DynamicTree.ancestor_mask` (the target's verify mask of a dynamic
  tree) without each node's grandparent (the root, for a node of depth 2).
- `NoGrandparentFrontier`: `dynamic_tree._Frontier` (a dynamic tree's drafting chunk) whose nodes do not
  see their fed grandparent (a difference only from depth 3 on: the root is committed history).
- `deeper_tree_cut`: the loop's adaptive tree pass verifies the static tree cut one level deeper than
  the round chose, and drafted (the deepest verified level holds tokens never drawn).
- `shallow_tree_draft`: the model drafter drafts its tree one level shallower than the policy chose (the
  same bug from the drafter's side: the deepest verified level holds zeros, never drawn).
- `unclipped_adaptive_lengths`: the loop does not clip a proposal's lengths to the adaptive policy's
  choice: a static tree proposal's N nodes fit no candidate, so every round verifies the plain one
  (still exact: only a test that asserts the rounds drafted sees it).
The loop mutants (`LOOP_MUTANTS`) patch the loop's internals as of this writing and record each time
they changed something while a program was traced: a test injecting one asserts that list non-empty,
so that a refactored loop makes the injection fail loudly instead of silently testing nothing.
`tests/helpers/mutant_plugin.py` injects any mutant of `PLUGIN_MUTANTS` into a whole pytest run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import sample
from specjax.speculative import acceptance
from specjax.speculative import loop
from specjax.speculative import plan as plan_lib
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.trees import dynamic as dynamic_tree
from specjax.speculative.trees import acceptance as tree_acceptance


def same_key_for_every_row(monkeypatch) -> None:
  """The shared-row-key mutant: `fold_in(key, b)` returns `key`, so row b's key does not depend on b."""
  monkeypatch.setattr(jax.random, "fold_in", lambda key, data: key)


def _unnormalised_residual(target_probs_xV, draft_probs_xW):
  fitted = acceptance._fit_vocab(draft_probs_xW, target_probs_xV.shape[-1])
  return jnp.maximum(target_probs_xV - fitted, 0.0)


def _reversed_residual(target_probs_xV, draft_probs_xW):
  fitted = acceptance._fit_vocab(draft_probs_xW, target_probs_xV.shape[-1])
  excess_xV = jnp.maximum(fitted - target_probs_xV, 0.0)
  total_x1 = excess_xV.sum(axis=-1, keepdims=True)
  return jnp.where(total_x1 > 0.0, excess_xV / jnp.where(total_x1 > 0.0, total_x1, 1.0), target_probs_xV)


RESIDUAL_MUTANTS = {
    "residual_is_q": lambda target_probs_xV, draft_probs_xW: target_probs_xV,
    "residual_not_renormalised": _unnormalised_residual,
    "residual_p_minus_q": _reversed_residual,
}


def chain_row(mutant: str):
  """`acceptance._verify_row` with the bug `mutant` ("inverse_ratio")."""
  assert mutant in ("inverse_ratio",)

  def verify_row(key, tokens_K, length, draft_probs_KxW, target_probs_K1xV):
    K = tokens_K.shape[0]
    uniform_key, residual_key = jax.random.split(key)
    q_K = acceptance._probability_of(target_probs_K1xV[:K], tokens_K)
    p_K = (jnp.ones(
        (K,), jnp.float32) if draft_probs_KxW is None else acceptance._probability_of(draft_probs_KxW, tokens_K))
    uniform_K = jax.random.uniform(uniform_key, (K,), jnp.float32)
    accepted_K = (uniform_K * q_K < p_K) & (jnp.arange(K) < length)  # the bug: min(1, p/q)
    num_accepted = jnp.sum(jnp.cumprod(accepted_K.astype(jnp.int32)))
    rejected = num_accepted < length
    at = jnp.minimum(num_accepted, K - 1)
    if draft_probs_KxW is None:
      draft_n_W = jnp.where(rejected, jax.nn.one_hot(tokens_K[at], target_probs_K1xV.shape[-1], dtype=jnp.float32), 0.0)
    else:
      draft_n_W = jnp.where(rejected, draft_probs_KxW[at], 0.0)
    next_token = sample(residual_key, acceptance.residual(target_probs_K1xV[num_accepted], draft_n_W))
    return num_accepted.astype(jnp.int32), next_token

  return verify_row


TREE_ROW_MUTANTS = ("inverse_ratio", "bonus_from_residual", "shared_sibling_uniform", "later_sibling_kept")


def tree_row(mutant: str):
  """`tree_acceptance._verify_tree_row` with the bug `mutant` (one of `TREE_ROW_MUTANTS`)."""
  assert mutant in TREE_ROW_MUTANTS

  def try_child(uniform, child, tokens_N, probs_NxW, q_V):
    accepted, rejected_q_V = tree_acceptance._try_child(uniform, child, tokens_N, probs_NxW, q_V)
    if mutant != "inverse_ratio":
      return accepted, rejected_q_V
    token = tokens_N[child - 1]
    p_x = (jnp.float32(1.0) if probs_NxW is None else acceptance._probability_of(probs_NxW[child -
                                                                                           1][None], token[None])[0])
    q_x = acceptance._probability_of(q_V[None], token[None])[0]
    return uniform * q_x < p_x, rejected_q_V  # the bug: min(1, p/q)

  def verify_tree_row(key, children_N1xC, path_N1xDt1, depth_N1, tokens_N, probs_NxW, target_probs_N1xV):
    depth, width = path_N1xDt1.shape[1] - 1, children_N1xC.shape[1]
    uniform_key, sample_key = jax.random.split(key)
    uniforms_DtxC = jax.random.uniform(uniform_key, (depth, width), jnp.float32)
    node, q_V, searching = jnp.int32(0), target_probs_N1xV[0], jnp.bool_(True)
    for level in range(depth):
      found, next_node = jnp.bool_(False), node
      for rank in range(width):
        child = children_N1xC[node, rank]
        trying = searching & ~found & (child > 0)
        uniform = uniforms_DtxC[level, 0 if mutant == "shared_sibling_uniform" else rank]
        accepted, rejected_q_V = try_child(uniform, jnp.maximum(child, 1), tokens_N, probs_NxW, q_V)
        updated = rank == 0 or mutant != "later_sibling_kept"
        q_V = jnp.where(trying & ~accepted & updated, rejected_q_V, q_V)
        next_node = jnp.where(trying & accepted, child, next_node)
        found = found | (trying & accepted)
      node, searching = next_node, found
      last_level_kept = mutant == "bonus_from_residual" and level == depth - 1
      q_V = jnp.where(found & (not last_level_kept), target_probs_N1xV[node], q_V)
    return path_N1xDt1[node], depth_N1[node], sample(sample_key, q_V)

  return verify_tree_row


def _elders_not_removed(probs_BxCxW, order_BxCxRk, ranks, tokens_BxC):
  return probs_BxCxW


def _elders_removed_not_renormalised(probs_BxCxW, order_BxCxRk, ranks, tokens_BxC):
  width = probs_BxCxW.shape[-1]
  elder_CxRk = jnp.arange(order_BxCxRk.shape[-1])[None, :] < jnp.asarray(ranks)[:, None]
  elders_BxCxW = jnp.any(
      (order_BxCxRk[..., None] == jnp.arange(width)[None, None, None, :]) & elder_CxRk[None, :, :, None], axis=2)
  return jnp.where(elders_BxCxW, 0.0, probs_BxCxW)


WITHOUT_REPLACEMENT_MUTANTS = {
    "elders_not_removed": _elders_not_removed, "elders_not_renormalised": _elders_removed_not_renormalised
}


def no_grandparent_ancestor_mask(tree):
  """`DynamicTree.ancestor_mask` without each node's ancestor two generations up (patch it onto the class)."""
  hops_BxN1xDt1 = dynamic_tree._hops(tree.parent, tree.max_depth)
  nodes_1x1xN1 = jnp.arange(tree.nodes_with_root)[None, None, :]
  mask_BxN1xN1 = jnp.any(hops_BxN1xDt1[..., None] == nodes_1x1xN1[..., None, :], axis=2)
  grandparent_BxN1xN1 = (hops_BxN1xDt1[..., 2, None] == nodes_1x1xN1) & (tree.depth >= 2)[..., None]
  return mask_BxN1xN1 & ~grandparent_BxN1xN1


class NoGrandparentFrontier(dynamic_tree._Frontier):
  """A frontier chunk of depth d (slots (d - 1) b ..) whose nodes do not see the slots of depth d - 2,
  where their grandparent was fed (patch it over `dynamic_tree._Frontier`)."""
  def ancestor_mask(self):
    grandparents = self.first - 2 * self.count
    if grandparents < 0:
      return self.mask
    slot_1x1xS = jnp.arange(self.mask.shape[-1])[None, None, :]
    return self.mask & ~((slot_1x1xS >= grandparents) & (slot_1x1xS < grandparents + self.count))


def inject(monkeypatch, mutant: str, chain: bool = False, tree: bool = False) -> None:
  """Injects `mutant` (a key of `RESIDUAL_MUTANTS`, "same_row_key", or a row mutant) into the chain
  and/or the tree rule's module."""
  if mutant == "same_row_key":
    same_key_for_every_row(monkeypatch)
  elif mutant in RESIDUAL_MUTANTS:
    if chain:
      monkeypatch.setattr(acceptance, "residual", RESIDUAL_MUTANTS[mutant])
    if tree:
      monkeypatch.setattr(tree_acceptance, "residual", RESIDUAL_MUTANTS[mutant])
  else:
    if chain:
      monkeypatch.setattr(acceptance, "_verify_row", chain_row(mutant))
    if tree:
      monkeypatch.setattr(tree_acceptance, "_verify_tree_row", tree_row(mutant))


def deeper_tree_cut(monkeypatch) -> list:
  """`SpeculativeLoop._verify_tree_pass` verifying the tree cut one level deeper than the adaptive round's
  candidate (whole cut or spine; a candidate already at the tree's depth stays): the drafter drew the
  chosen cut only, so the extra level's tokens were never drawn (probability 0 under the draft: the rule
  accepts them wherever the target gives them mass). Returns the candidates it deepened (at trace time)."""
  real, deepened = loop.SpeculativeLoop._verify_tree_pass, []

  def verify_tree_pass(self, target_params, features, round_, candidate, target_cache):
    if candidate is not None and candidate.length < round_.proposal.verified_tree.max_depth:
      deepened.append(candidate)
      candidate = candidate._replace(length=candidate.length + 1)
    return real(self, target_params, features, round_, candidate, target_cache)

  monkeypatch.setattr(loop.SpeculativeLoop, "_verify_tree_pass", verify_tree_pass)
  return deepened


def shallow_tree_draft(monkeypatch) -> list:
  """`ModelDrafter.propose` drafting one level fewer than the plan wants: the deepest level the loop
  verifies holds tokens never drawn (zeros, with probability 0 under the draft), which the tree rule
  then accepts wherever the target gives them mass. Returns the plans it shortened (at trace time)."""
  real, shortened = ModelDrafter.propose, []

  def propose(self, state, target_cache, pending_B, sampling, key, plan):
    shortened.append(plan)
    shallower = plan.replace(wanted_B=jnp.maximum(plan.wanted_B - 1, 0))
    return real(self, state, target_cache, pending_B, sampling, key, shallower)

  monkeypatch.setattr(ModelDrafter, "propose", propose)
  return shortened


def unclipped_adaptive_lengths(monkeypatch) -> list:
  """The loop's `plan.clip` (the proposal's lengths cut to the adaptive policy's choice) left out: a
  drafter's lengths are kept beyond the policy's choice. A static tree proposal's lengths are its N
  nodes, longer than any candidate's depth, so no candidate fits and every round verifies candidate 0,
  the plain step (still exact). Returns the lengths it left unclipped (at trace time)."""
  skipped = []

  def clip(self, lengths_B):
    skipped.append(lengths_B)
    return lengths_B

  monkeypatch.setattr(plan_lib.ChosenPlan, "clip", clip)
  return skipped


LOOP_MUTANTS = {
    "deeper_tree_cut": deeper_tree_cut, "shallow_tree_draft": shallow_tree_draft,
    "unclipped_adaptive_lengths": unclipped_adaptive_lengths
}


def _tree_rule_mutant(name):
  return lambda monkeypatch: inject(monkeypatch, name, tree=True)


PLUGIN_MUTANTS = {
    **LOOP_MUTANTS, **{
        name: _tree_rule_mutant(name) for name in TREE_ROW_MUTANTS + tuple(RESIDUAL_MUTANTS)
    }, "no_grandparent_ancestor_mask": lambda monkeypatch: monkeypatch.setattr(
        dynamic_tree.DynamicTree, "ancestor_mask", no_grandparent_ancestor_mask)
}
