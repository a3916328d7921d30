"""The model drafter's trees (`model.ModelDrafter` with a `tree`): a static tree drafted level by level
after the catch-up pass, its cut at the plan's depth or only that cut's spine (`trees.drafting`), or a
dynamic tree grown every round (`trees.dynamic`); after the round the draft cache keeps the accepted path,
compacted like the target's. The catch-up pass and the lag are the model drafter's own (`model`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from specjax.models.kv_cache import KVCache
from specjax.models.transformer import forward_hidden
from specjax.sampling import SamplingParams
from specjax.speculative.drafters.draft_head import draft_inputs, draft_logits
from specjax.speculative.plan import FixedPlan
from specjax.speculative.proposal import Proposal, full
from specjax.speculative.trees.drafting import Grower, draft_static
from specjax.speculative.trees.dynamic import draft_dynamic_tree


class ModelTrees:
  """The tree hooks of `ModelDrafter` (`trees.shapes`: `propose_static`, `commit_static`,
  `propose_dynamic`, `commit_dynamic`), written against its catch-up pass and lag."""

  def propose_static(self, state: Any, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
                     plan: FixedPlan) -> tuple[Proposal, Any]:
    """A tree proposal (`tree_drafting`) after [history, pending], cut at the plan's depth, or only that
    cut's spine where `plan.spine` holds (drawn as a chain: each level's pass feeds one node, not the
    level; its tokens land at the spine's nodes). The catch-up pass feeds [lag, pending's ids]
    (`_catch_up`; at depth 0 it defers: nothing runs), the last of them the tree's root; the draft cache
    then holds every node drafted beyond the history (uncommitted), for `commit_static` to compact the
    accepted path."""
    root_hidden_BxD, state, cache, num_valid_B, catch_up_passes = self._catch_up(state, pending_B, plan.drafts)

    def feed_level(cache: KVCache, tokens_BxLv: jax.Array, level, depth: int):
      return forward_hidden(self.config, self.params, draft_inputs(self.config, self.head, tokens_BxLv), cache,
                            tree=level)

    # The nodes are the head's ids, fed through `draft_inputs`; the root's token is not read.
    grower = Grower(feed_level, lambda hidden: draft_logits(self.config, self.params, self.head, hidden),
                    feeds_leaves=True, root_outputs=root_hidden_BxD[:, None])
    cache, (tokens_BxN, probs_BxNxW) = draft_static(self.tree, self.tree_children, jnp.zeros_like(pending_B),
                                                    sampling, key, grower,
                                                    cache.advance(jnp.maximum(num_valid_B - 1, 0)), plan)
    proposal = full(tokens_BxN, probs_BxNxW).replace(tree=self.tree, calls=catch_up_passes + jnp.int32(plan.depth))
    return proposal, state.replace(cache=cache.replace(lengths=state.cache.lengths),
                                   spine=jnp.bool_(False) if plan.spine is None else plan.spine)

  def commit_static(self, state: Any, proposal: Proposal, num_committed_B: jax.Array,
                    target_hidden_BxK1xD: jax.Array) -> Any:
    """`proposal` is the accepted path (`Proposal.along`); the root is pending's last id."""
    committed_B = num_committed_B > 0
    fed_B = committed_B & ~state.deferred  # its lag and pending's ids were written before the root
    cache = state.cache.advance(jnp.where(fed_B, state.lag + state.pending_ids - 1, 0))
    if not self.tree.is_chain:  # a spine round's keys are already in path order (`propose_static`)
      cache = cache.compact(jnp.where(state.spine, jnp.arange(proposal.path.shape[1]), proposal.path))
    return state.replace(cache=cache.advance(jnp.where(fed_B, num_committed_B, 0)),
                         lag=jnp.where(state.deferred, self._deferred_lag(state, committed_B),
                                       jnp.where(committed_B, 0, state.lag)))

  def propose_dynamic(self, state: Any, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
                      plan: FixedPlan) -> tuple[Proposal, Any]:
    """A dynamic tree (`dynamic_tree`) grown after [history, (lagging token,) pending]: the catch-up pass
    gives the root's distribution, then Dt - 1 frontier chunks. The state keeps the cache at its committed
    length and each node's slot beyond the root, for `commit_dynamic`."""
    hidden_BxD, state, cache, num_valid_B, _ = self._catch_up(state, pending_B)
    root_logits_BxW = draft_logits(self.config, self.params, self.head, hidden_BxD)
    tokens_BxN, tree, slots_BxN1, cache = draft_dynamic_tree(self.config, self.params, self.head, self.tree,
                                                             cache.advance(num_valid_B), root_logits_BxW,
                                                             sampling)
    proposal = full(tokens_BxN, calls=self.tree.max_depth).replace(dynamic_tree=tree)
    return proposal, state.replace(cache=cache.replace(lengths=state.cache.lengths), node_slots=slots_BxN1)

  def commit_dynamic(self, state: Any, proposal: Proposal, num_committed_B: jax.Array,
                     target_hidden_BxK1xD: jax.Array) -> Any:
    """After a dynamic tree's round the cache holds [lag, root] then the frontier nodes at their slots:
    the accepted nodes a_1 .. a_{n-1} (all expanded, so all fed) move behind the root and a_n, perhaps
    never fed, becomes the lag, fed by the next catch-up pass (`proposal`: the accepted path)."""
    path_BxDt1, path_tokens_BxDt = proposal.path, proposal.tokens
    committed_B = num_committed_B > 0
    accepted_B = jnp.maximum(num_committed_B - 1, 0)
    cache = state.cache.advance(jnp.where(committed_B, state.pending_ids + state.lag, 0))
    if path_BxDt1.shape[1] > 2:  # depth >= 2: some accepted node may have been fed
      sources_BxM = jnp.take_along_axis(state.node_slots, path_BxDt1[:, 1:-1], axis=1)
      cache = cache.compact(jnp.maximum(sources_BxM, 0))
    lagging_B = committed_B & (accepted_B > 0)
    last_accepted_B = jnp.take_along_axis(path_tokens_BxDt, jnp.maximum(accepted_B - 1, 0)[:, None], axis=1)[:, 0]
    state = state.replace(cache=cache.advance(jnp.where(committed_B, jnp.maximum(accepted_B - 1, 0), 0)))
    return self._lagging(state, committed_B, lagging_B, last_accepted_B)
