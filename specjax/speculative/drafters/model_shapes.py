"""What the model drafter (`model.ModelDrafter`) drafts each round and how it commits it, per shape
(`trees.shapes`): the hooks of a chain, a static tree and a dynamic tree. The catch-up pass and the lag
are the draft model's own (`model`).

A chain: after the catch-up pass, one pass per draft token while some row is still drafting (`plan.depth`
at most; early stopping, `stop_threshold`); the last accepted token, never fed, lags.

A static tree (`ModelDrafter.tree`) is proposed each round instead of a chain (`tree_drafting`:
children i.i.d., without replacement or the top tokens, `tree_children`); the loop verifies it with
`tree_acceptance` and `commit` compacts the accepted path in the draft cache: its root is the last id
the catch-up pass feeds, then one pass per level and one for the leaves, so a tree
leaves no accepted token behind (its lag is only what plain rounds deferred). The adaptive K policy's
rounds draft its cut at the chosen depth d: the catch-up and d passes, none for a plain round. A
`dynamic_tree.DynamicSpec` grows each row's own tree every round instead (EAGLE-2: the top tokens of
the most confident nodes under a static node budget); its last accepted node lags like a chain's d_K.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from specjax.models.kv_cache import KVCache
from specjax.models.transformer import forward_hidden
from specjax.sampling import SamplingParams, tokens_and_probabilities
from specjax.speculative.drafters.draft_head import draft_inputs, draft_logits
from specjax.speculative.plan import RoundPlan
from specjax.speculative.proposal import Proposal, full
from specjax.speculative.trees.drafting import Grower, draft_static
from specjax.speculative.trees.dynamic import draft_dynamic_tree


class ModelShapes:
  """The shape hooks of `ModelDrafter` (`trees.shapes`), written against its catch-up pass and lag."""
  def propose_chain(self, state: Any, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
                    plan: RoundPlan) -> tuple[Proposal, Any]:
    """Up to `plan.depth` draft tokens per row after [history, pending], each row stopping at its first
    unconfident one (`stop_threshold`)."""
    # A plain round (the policy wants no token of any row) may skip the draft entirely (`_catch_up`).
    hidden_BxD, state, cache, num_valid_B, catch_up_passes = self._catch_up(state, pending_B, plan.drafts)
    keys_K = jax.random.split(key, plan.k)
    # No head for a plain round where branches are cheap (narrow passes: CPU); its d_1 is never verified.
    first = (plan.unless_plain(self._draw, self._no_draw, hidden_BxD, keys_K[0], sampling)
             if self.config.narrow_passes else self._draw(hidden_BxD, keys_K[0], sampling))
    fed, cache, tokens_BxK, probs_BxKxV, confident_BxK = self._draw_rest(cache, num_valid_B, first, keys_K, sampling,
                                                                         plan)
    # Row b proposes its leading confident tokens, at most fed + 1 of them (all K when stopping is off).
    lengths_B = jnp.sum(jnp.cumprod(confident_BxK, axis=1), axis=1).astype(jnp.int32)
    # The cache now holds [lag, pending's ids, d_1 .. d_fed] beyond the history, uncommitted (nothing
    # when deferred).
    proposal = Proposal(tokens=tokens_BxK, lengths=lengths_B, probs=probs_BxKxV, calls=fed + catch_up_passes)
    return proposal, state.replace(cache=cache.replace(lengths=state.cache.lengths), fed=fed)

  def _draw(self, hidden_BxD: jax.Array, step_key: jax.Array,
            sampling: SamplingParams) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """A chain's next draft token after the draft's hidden state `hidden_BxD`: (token [B], its distribution
    [B, V] or None when greedy (a point mass), confident [B]), under `sampling`'s constraint (its state after
    the tokens before this one)."""
    logits_BxV = draft_logits(self.config, self.params, self.head, hidden_BxD)
    token_B, probs_BxV = tokens_and_probabilities(step_key, logits_BxV, sampling)
    # Confident: the top probability of the draft's own distribution, softmax(logits) before
    # temperature, top-k and top-p, reaches the threshold (always, when it is 0: static, so no
    # softmax is spent on it). The processed distribution would not do: greedy decoding makes it a
    # point mass, always "confident".
    if not self.stop_threshold:
      return token_B, probs_BxV, jnp.ones(token_B.shape, bool)
    top_B = jnp.exp(jnp.max(logits_BxV, axis=-1) - jax.nn.logsumexp(logits_BxV, axis=-1))
    return token_B, probs_BxV, top_B >= self.stop_threshold

  def _no_draw(self, hidden_BxD: jax.Array, step_key: jax.Array, sampling: SamplingParams):
    """`_draw`'s zeros, without running the head (a plain round's d_1)."""
    return jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype),
                        jax.eval_shape(self._draw, hidden_BxD, step_key, sampling))

  def _draw_rest(self, cache: KVCache, num_valid_B: jax.Array, first: tuple, keys_K: jax.Array,
                 sampling: SamplingParams, plan: RoundPlan):
    """Feeds d_i (i = 1 .. K-1) to draw d_{i+1} while some row is still drafting: a row stops at its first
    draft token whose distribution's top probability is below `stop_threshold` (that token is not
    proposed); `first` is d_1's `_draw`. Returns (fed: the draft tokens fed, the same for every row, the
    cache, tokens [B, K], distributions [B, K, V] or None, confident [B, K]: d_1 .. d_i confident, False
    past the drawn tokens)."""
    k, (token_B, probs_BxV, confident_B) = plan.k, first
    tokens_BxK = jnp.zeros((len(token_B), k), jnp.int32).at[:, 0].set(token_B)
    # Greedy proposals are point masses: no [B, K, V] buffer.
    probs_BxKxV = None if probs_BxV is None else jnp.zeros(
        (len(token_B), k, self.vocab_size), jnp.float32).at[:, 0].set(probs_BxV)

    # Row b is still drafting while its last drawn token is confident; the next pass runs only while some
    # row wants and may still draw a token.
    def more(carry):
      fed, _, _, _, confident_BxK = carry
      return (fed + 1 < plan.depth) & jnp.any(confident_BxK[:, fed])

    def step(carry):
      fed, cache, tokens_BxK, probs_BxKxV, confident_BxK = carry
      hidden_Bx1xD, cache = forward_hidden(self.config, self.params,
                                           draft_inputs(self.config, self.head, tokens_BxK[:, fed, None]), cache)
      next_B, probs_BxV, confident_B = self._draw(hidden_Bx1xD[:, 0], keys_K[fed + 1],
                                                  sampling.after(tokens_BxK, fed + 1))
      return (fed + 1, cache.advance(jnp.ones_like(next_B)), tokens_BxK.at[:, fed + 1].set(next_B),
              None if probs_BxV is None else probs_BxKxV.at[:, fed + 1].set(probs_BxV),
              confident_BxK.at[:, fed + 1].set(confident_BxK[:, fed] & confident_B))

    confident_BxK = jnp.zeros((len(token_B), k), bool).at[:, 0].set(confident_B)
    return jax.lax.while_loop(more, step,
                              (jnp.int32(0), cache.advance(num_valid_B), tokens_BxK, probs_BxKxV, confident_BxK))

  def commit_chain(self, state: Any, proposal: Proposal, num_committed_B: jax.Array,
                   target_hidden_BxK1xD: jax.Array) -> Any:
    committed_B = num_committed_B > 0
    # Written beyond the history: the lag, pending's ids, d_1 .. d_fed. A row that accepted n > fed draft
    # tokens commits d_n without its keys: it lags by that one token.
    held_B = jnp.where(committed_B & ~state.deferred,
                       state.lag + state.pending_ids + jnp.minimum(num_committed_B - 1, state.fed), 0)
    lagging_B = num_committed_B > state.fed + 1
    last_accepted_B = jnp.take_along_axis(proposal.tokens, jnp.maximum(num_committed_B - 2, 0)[:, None], axis=1)[:, 0]
    fed_state = self._lagging(state.replace(cache=state.cache.advance(held_B)), committed_B, lagging_B, last_accepted_B)
    return fed_state.replace(lag=jnp.where(state.deferred, self._deferred_lag(state, committed_B), fed_state.lag))

  def propose_static(self, state: Any, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
                     plan: RoundPlan) -> tuple[Proposal, Any]:
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
    cache, (tokens_BxN, probs_BxNxW) = draft_static(self.tree, self.tree_children, jnp.zeros_like(pending_B), sampling,
                                                    key, grower, cache.advance(jnp.maximum(num_valid_B - 1, 0)), plan)
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
    return state.replace(
        cache=cache.advance(jnp.where(fed_B, num_committed_B, 0)), lag=jnp.where(state.deferred,
                                                                                 self._deferred_lag(state, committed_B),
                                                                                 jnp.where(committed_B, 0, state.lag)))

  def propose_dynamic(self, state: Any, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
                      plan: RoundPlan) -> tuple[Proposal, Any]:
    """A dynamic tree (`dynamic_tree`) grown after [history, (lagging token,) pending]: the catch-up pass
    gives the root's distribution, then Dt - 1 frontier chunks. The state keeps the cache at its committed
    length and each node's slot beyond the root, for `commit_dynamic`."""
    hidden_BxD, state, cache, num_valid_B, _ = self._catch_up(state, pending_B)
    root_logits_BxW = draft_logits(self.config, self.params, self.head, hidden_BxD)
    tokens_BxN, tree, slots_BxN1, cache = draft_dynamic_tree(self.config, self.params, self.head, self.tree,
                                                             cache.advance(num_valid_B), root_logits_BxW, sampling)
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
