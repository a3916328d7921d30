"""The `EagleDrafter`: an EAGLE head (`eagle_head`: one decoder block drafting from the target's own
hidden states; its weights load through `eagle_io`) run inside the speculative loop.

Drafting. The target's cache holds x_0 .. x_{n-1} (x_n is pending); the head's cache holds the pairs
t = 0 .. n - 2, built from the *target's* features, and `feature` holds fused f_{n-1}. A proposal
feeds (f_{n-1}, x_n), draws d_1, then feeds its own output with each draft token (out, d_i) -> d_{i+1}:
K head passes, written beyond the head's length and never committed. After the target verifies
[x_n, d_1 .. d_K] (features g_0 .. g_K), `commit` feeds the pairs (f_{n-1}, x_n), (g_0, d_1) ..
(g_{K-1}, d_K) in one pass and keeps the first n + 1 of a row that committed n + 1 tokens; g_n becomes
the new `feature`. The head's history is always the target's features, never its own guesses.

Trees: a static `tree` is drafted level by level (a node reads its parent's head output and its own
token, attending to the head's history and its ancestors); a dynamic one (`DynamicSpec`, EAGLE-2) grows
each row's tree from the root pass (f_{n-1}, x_n), one frontier chunk per depth, its nodes reading their
parents' head outputs the same way (`dynamic_tree.grow_dynamic_tree`). After verification the accepted
path is committed like a chain, from the target's features along it, so nothing needs compacting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from specjax import partitioning
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.transformer import Params, prefill_features
from specjax.sampling import SamplingParams, tokens_and_probabilities
from specjax.speculative.drafters.base import DraftPass, DrafterSettings, ModelBackedDrafter, draft_chain
from specjax.speculative.drafters.draft_head import (DraftHead, add_vocab_options, check_vocab_options,
                                                     restricted_draft_head)
from specjax.speculative.drafters.eagle_head import EagleConfig, check_head, fuse, head_forward, head_logits
from specjax.speculative.drafters.eagle_io import load_head
from specjax.speculative.trees.dynamic import DynamicSpec, DynamicTree, grow_dynamic_tree
from specjax.speculative.plan import RoundPlan
from specjax.speculative.proposal import Proposal, full
from specjax.speculative.trees.tree import Tree
from specjax.speculative.trees.drafting import Grower, children_error, draft_static

if TYPE_CHECKING:
  from specjax.models.load import LoadedModel


@flax.struct.dataclass
class EagleState:
  cache: KVCache  # [1, B, S, G, Dh] head cache: pairs (f_t, x_{t+1}) for t < the target's length - 1
  feature: jax.Array  # [B, D] fused target feature f_{n-1} of the target's last cached position
  pending: jax.Array  # [B] int32: the pending token x_n of the last proposal (the first pair `commit` feeds)


class EagleDrafter(ModelBackedDrafter):
  """Drafts K tokens per round with an EAGLE head (see the module docstring)."""

  name: ClassVar[str] = "eagle"
  reads_prompt_features: ClassVar[bool] = True
  cache_name: ClassVar[str] = "EAGLE head"
  config: EagleConfig = flax.struct.field(pytree_node=False)
  params: Params  # the head's own weights (`init_head_params`)
  target_config: ModelConfig = flax.struct.field(pytree_node=False)
  target_params: Params  # the target's: its embedding and output head are shared
  vocab: DraftHead | None = None  # a restricted output head (EAGLE-3's draft vocabulary), None = the target's
  cache_sharding: Any = flax.struct.field(pytree_node=False, default=None)  # the head cache's placement on a mesh
  # Draft this static tree, or a dynamic tree of this budget, each round; None = a chain.
  tree: Tree | DynamicSpec | None = flax.struct.field(pytree_node=False, default=None)
  tree_children: str = flax.struct.field(pytree_node=False, default="iid")  # `tree_drafting.CHILDREN`

  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    return add_vocab_options(ml_collections.ConfigDict())  # used when the head brings no vocabulary of its own

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    if not settings.draft:
      raise ConfigError("config.draft is empty but config.drafter is 'eagle': give the head's directory")
    check_vocab_options(settings.options, settings.group)
    cls.check_tree_children(settings)

  @classmethod
  def build(cls, settings: DrafterSettings, target: LoadedModel, draft: LoadedModel | None,
            log: Callable[[str], None] = print) -> tuple[EagleDrafter, dict]:

    config, params, vocab = load_head(settings.draft, target.config, target.params)
    coverage, size = None, settings.options.vocab
    if vocab is None:
      vocab, coverage = restricted_draft_head(size, settings.options.vocab_corpus, target, target, log)
    elif size not in (0, vocab.tokens_Vd.shape[0]):
      raise ConfigError(f"{settings.field('vocab')} {size}: the head {settings.draft} brings its own restricted "
                        f"vocabulary of {vocab.tokens_Vd.shape[0]} tokens (set it to 0 or to that size)")
    drafter = cls(config, params, target.config, target.params, vocab,
                  cache_sharding=partitioning.cache_sharding(config.block, target.part), tree=settings.tree,
                  tree_children=settings.tree_children)
    return drafter, {"eagle_feature_layers": list(config.feature_layers), "draft_vocab_coverage": coverage}

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return self.config.feature_layers

  @property
  def vocab_size(self) -> int:
    return self.target_config.vocab_size

  @property
  def cache_config(self) -> ModelConfig:
    return self.config.block

  def check(self, target_config: ModelConfig) -> None:
    check_head(self.config, self.params, target_config, self.vocab)
    if children_error(self.tree_children):
      raise ValueError(children_error(self.tree_children))

  def draft_pass(self) -> DraftPass:
    """Approximately one head pass: one block of the target's and its output head (the head's q/k/v
    read 2D, not D: a few percent more in a block)."""
    return DraftPass(self.target_config, self.target_params, self.vocab, layers=(0,))

  def lookahead(self, k: int) -> int:
    """`commit` writes K + 1 pairs beyond a length one short of the target's (a tree proposal: N + 1
    nodes; a dynamic tree's proposal: the root and its frontier chunks)."""
    return self.shape.lookahead(k)

  def _embedding(self) -> jax.Array:
    return self.target_params["embed"]["embedding"]

  def init(self, storage: KVCache, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
           target_cache: KVCache) -> EagleState:
    """Prefills the head with the target's features of the prompts, recomputed by a target prefill of
    its own (with a temporary cache of the prompts' size). The loop does not call this: its prefill
    hands the features to `init_from_features`."""
    scratch = init_cache(self.target_config, *prompts_BxP.shape)
    _, features_BxPxF, _ = prefill_features(self.target_config, self.target_params, prompts_BxP, prompt_lengths_B,
                                            scratch, self.feature_layers)
    return self.init_from_features(storage, prompts_BxP, prompt_lengths_B, features_BxPxF)

  def init_from_features(self, storage: KVCache, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
                         features_BxPxF: jax.Array) -> EagleState:
    """The state after the right-padded prompts, from the target's features of every prompt position
    [B, P, F] (`prefill_features`): the head's cache holds the pairs (f_t, x_{t+1}), t < length - 1."""
    batch, width = prompts_BxP.shape
    fused_BxPxD = fuse(self.config, self.params, features_BxPxF)
    cache = storage.replace(lengths=jnp.zeros((batch,), jnp.int32))  # whatever it held before
    if width > 1:  # pairs (f_t, x_{t+1}), t < P - 1
      _, cache = head_forward(self.config, self.params, self._embedding(), prompts_BxP[:, 1:], fused_BxPxD[:, :-1],
                              cache)
    last_B = jnp.maximum(prompt_lengths_B - 1, 0)
    return EagleState(cache=cache.advance(last_B), feature=jnp.take_along_axis(fused_BxPxD, last_B[:, None, None],
                                                                               axis=1)[:, 0], pending=jnp.zeros(
                                                                                   (batch,), jnp.int32))

  def propose_static(self, state: EagleState, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
                     plan: RoundPlan) -> tuple[Proposal, EagleState]:
    """A static tree drawn level by level: the root pairs (f_{n-1}, x_n), every other node (its parent's
    head output, its token), each level one tree-masked head pass written beyond the head's length
    (scratch: `commit` rewrites the accepted path from the target's features). Cut at the plan's depth
    (that many passes), or only the cut's spine where the plan says so (one node a pass: `draft_static`)."""
    batch = pending_B.shape[0]

    def feed_level(carry, tokens_BxLv, level, depth):
      cache, outs_BxN1xD = carry
      parent_N1 = np.maximum(np.asarray(level.tree.parent), 0)  # of the tree drawn: the whole, or its spine
      nodes = np.arange(level.first, level.first + level.count)
      fused_BxLvxD = state.feature[:, None] if depth == 0 else outs_BxN1xD[:, parent_N1[nodes]]
      out_BxLvxD, cache = head_forward(self.config, self.params, self._embedding(), tokens_BxLv, fused_BxLvxD, cache,
                                       tree=level)
      return out_BxLvxD, (cache, outs_BxN1xD.at[:, nodes].set(out_BxLvxD))

    def head(out_BxLvxD):
      return head_logits(self.config, self.params, self.target_config, self.target_params, self.vocab, out_BxLvxD)

    outs_BxN1xD = jnp.zeros((batch, self.tree.nodes_with_root, self.config.block.d_model), self.config.block.jnp_dtype)
    _, (tokens_BxN, probs_BxNxW) = draft_static(self.tree, self.tree_children, pending_B, sampling, key,
                                                Grower(feed_level, head), (state.cache, outs_BxN1xD), plan)
    proposal = full(tokens_BxN, probs_BxNxW).replace(tree=self.tree, calls=jnp.int32(plan.depth))
    return proposal, state.replace(pending=pending_B)

  def draft_dynamic_tree(self, state: EagleState, pending_B: jax.Array,
                         sampling: SamplingParams) -> tuple[jax.Array, DynamicTree, jax.Array, jax.Array]:
    """A dynamic tree: the root pass (f_{n-1}, x_n) gives the root's logits, then each frontier chunk
    feeds (its nodes' parents' head outputs, their tokens), written after the root beyond the head's
    length (scratch, as for a static tree): Dt head passes. Returns the tokens [B, N], the trees, each
    node's frontier slot [B, N + 1] (-1: not fed) and the head outputs of the frontier slots [B, Fr, D]."""
    spec, batch = self.tree, pending_B.shape[0]
    root_Bx1xD, cache = head_forward(self.config, self.params, self._embedding(), pending_B[:, None],
                                     state.feature[:, None], state.cache)
    root_logits_BxV = head_logits(self.config, self.params, self.target_config, self.target_params, self.vocab,
                                  root_Bx1xD[:, 0])

    def score_frontier(carry, chunk_Bxb, frontier, parent_slots_Bxb):
      cache, outs_BxFrxD = carry  # head outputs of the fed frontier slots
      parents_BxbxD = jnp.take_along_axis(outs_BxFrxD, jnp.maximum(parent_slots_Bxb, 0)[:, :, None], axis=1)
      fused_BxbxD = jnp.where((parent_slots_Bxb >= 0)[:, :, None], parents_BxbxD, root_Bx1xD)
      out_BxbxD, cache = head_forward(self.config, self.params, self._embedding(),
                                      jnp.minimum(chunk_Bxb, self.vocab_size - 1), fused_BxbxD, cache, tree=frontier)
      logits_BxbxV = head_logits(self.config, self.params, self.target_config, self.target_params, self.vocab,
                                 out_BxbxD)
      return logits_BxbxV, (cache, outs_BxFrxD.at[:, frontier.first:frontier.first + frontier.count].set(out_BxbxD))

    outs_BxFrxD = jnp.zeros((batch, (spec.depth - 1) * spec.expand, self.config.block.d_model),
                            self.config.block.jnp_dtype)
    tokens_BxN, tree, slots_BxN1, (_, outs_BxFrxD) = grow_dynamic_tree(spec, root_logits_BxV, sampling,
                                                                       score_frontier, (cache.advance(
                                                                           jnp.ones_like(pending_B)), outs_BxFrxD))
    return tokens_BxN, tree, slots_BxN1, outs_BxFrxD

  def propose_dynamic(self, state: EagleState, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
                      plan: RoundPlan) -> tuple[Proposal, EagleState]:
    tokens_BxN, tree, _, _ = self.draft_dynamic_tree(state, pending_B, sampling)
    return full(tokens_BxN, calls=self.tree.depth).replace(dynamic_tree=tree), state.replace(pending=pending_B)

  def propose_chain(self, state: EagleState, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
                    plan: RoundPlan) -> tuple[Proposal, EagleState]:
    def step(carry, step_key, sampling):
      cache, fused_BxD, token_B = carry
      out_Bx1xD, cache = head_forward(self.config, self.params, self._embedding(), token_B[:, None], fused_BxD[:, None],
                                      cache)
      logits_BxV = head_logits(self.config, self.params, self.target_config, self.target_params, self.vocab,
                               out_Bx1xD[:, 0])
      next_B, probs_BxV = tokens_and_probabilities(step_key, logits_BxV, sampling)
      return (cache.advance(jnp.ones_like(next_B)), out_Bx1xD[:, 0], next_B), (next_B, probs_BxV)

    (cache, _, _), proposal = draft_chain(step, (state.cache, state.feature, pending_B), key, plan, sampling)
    # The pairs written beyond the head's length are scratch: `commit` rewrites them from the target. The
    # state keeps the written cache (at its old length): dropping it would make XLA copy the whole cache
    # so that the old one survives the chain.
    return proposal, state.replace(cache=cache.replace(lengths=state.cache.lengths), pending=pending_B)

  def commit_chain(self, state: EagleState, proposal: Proposal, num_committed_B: jax.Array,
                   target_hidden_BxK1xF: jax.Array) -> EagleState:
    """Every shape's commit: the accepted path is a chain, fed from the target's features along it."""
    fused_BxK1xD = fuse(self.config, self.params, target_hidden_BxK1xF)
    features_BxK1xD = jnp.concatenate([state.feature[:, None], fused_BxK1xD[:, :-1]], axis=1)
    tokens_BxK1 = jnp.concatenate([state.pending[:, None], proposal.tokens], axis=1)
    _, cache = head_forward(self.config, self.params, self._embedding(), tokens_BxK1, features_BxK1xD, state.cache)
    newest_BxD = jnp.take_along_axis(fused_BxK1xD, jnp.maximum(num_committed_B - 1, 0)[:, None, None], axis=1)[:, 0]
    return state.replace(cache=cache.advance(num_committed_B), feature=jnp.where((num_committed_B > 0)[:, None],
                                                                                 newest_BxD, state.feature))
