"""The model drafter: a small language model with its own static KV cache, sampled autoregressively.

Its forward passes feed each draft token d_1 .. d_{K-1} once, so after a round that accepted all K
tokens the cache lacks d_K (never fed). The next proposal then starts with the two-token chunk
[d_K, pending] instead of [pending] and reads the logits at the last valid position of each row:
K forward passes per proposal, never an extra pass just to catch up (and a 1-token first pass when
no row is behind). Only the position a pass samples from goes through the output head.

Early stopping (`stop_threshold` > 0, HF's `assistant_confidence_threshold`): a row proposes its draft
tokens only while the top probability of the draft's own distribution (softmax of its logits, before
temperature, top-k and top-p) reaches the threshold; the first unconfident
token and everything after it are not proposed (never accepted). Once no row is drafting the proposal
stops (fewer draft passes), and the loop verifies with the narrowest pass that holds the longest live
proposal (`verify_widths`). Exactness is unchanged: what is proposed was drawn from p, and a row's
later slots are simply never accepted.

Greedy decoding proposes the argmax tokens as point masses (no [B, K, V] distributions are built).

`tree` (optional, static) makes the drafter propose that static tree each round instead of a chain
(`tree_drafting`: children i.i.d., without replacement or the top tokens, `tree_children`); the loop
verifies it with `tree_acceptance` and `commit` compacts the accepted path in the draft cache. A
`dynamic_tree.DynamicSpec` grows each row's own tree every round instead (EAGLE-2: the top tokens of
the most confident nodes under a static node budget); its last accepted node lags like a chain's d_K.

`head` (optional) restricts the output head to a frequent subset of the vocabulary (see
`draft_head`): cheaper draft steps, same exactness.

The draft's head may have fewer or more rows than the target's (same tokenizer, padding rows): its
distributions span its own W ids and the acceptance rule extends the smaller side with zeros. Ids the
draft cannot embed (W <= id < V: prompt tokens or target draws there) are fed to it as its last id
(`_embeddable`): its guesses after them may be poor, never inexact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections

from specjax import inplace, partitioning
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Params, forward_hidden, prefill
from specjax.sampling import SamplingParams, tokens_and_probabilities
from specjax.speculative.drafters.base import DraftPass, DrafterSettings, ModelBackedDrafter, short_proposal_widths
from specjax.speculative.drafters.draft_head import (DraftHead, add_vocab_options, check_vocab_options, draft_logits,
                                                     restricted_draft_head)
from specjax.speculative.trees.dynamic import DynamicSpec, draft_dynamic_tree
from specjax.speculative.proposal import Proposal, full
from specjax.speculative.trees.tree import Tree
from specjax.speculative.trees.drafting import children_error, draft_tree

if TYPE_CHECKING:
  from specjax.models.load import LoadedModel


@flax.struct.dataclass
class ModelDraftState:
  cache: KVCache  # [L, B, S, G, Dh] draft cache: the history except `lagging_token` when `behind`
  lagging_token: jax.Array  # [B] int32: the previous round's last accepted draft token d_n
  behind: jax.Array  # [B] bool: the cache lacks `lagging_token` (it was accepted but never fed)
  fed: jax.Array  # [] int32: draft tokens fed to the draft in the last proposal (K - 1 unless it stopped)
  node_slots: jax.Array | None = None  # [B, N + 1] int32, dynamic trees: each node's cache slot beyond the root


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
  """The acceptance ratio compares probabilities of the same token ids: the tokenizers must agree on
  every id both heads score. The heads may differ in size (padding rows, e.g. Qwen2.5-0.5B's 151,936
  against Qwen2.5-7B's 152,064): the acceptance rule gives the smaller one probability 0 beyond it."""
  shared = min(draft.config.vocab_size, target.config.vocab_size)
  if draft.tokenizer.fingerprint(below=shared) != target.tokenizer.fingerprint(below=shared):
    raise ValueError(f"draft {draft.name} and target {target.name} have different tokenizers: some id "
                     f"below {shared} (the range both heads score) maps to different tokens")


def _settings_error(stop_threshold: float, tree, tree_children: str) -> str | None:
  """What is wrong with the early-stop threshold, the tree and its children (None when nothing is),
  starting with the setting's name ("stop_threshold ...", "tree ...", "tree_children ...")."""
  if not 0.0 <= stop_threshold < 1.0:
    return f"stop_threshold must be in [0, 1) (0 = off), got {stop_threshold}"
  if tree is not None and stop_threshold:
    return "tree and the stop_threshold exclude each other: a tree drafter does not stop early"
  return children_error(tree_children)


class ModelDrafter(ModelBackedDrafter):
  """A small model drafting K tokens per round from its own cache (see the module docstring)."""

  name: ClassVar[str] = "model"
  loads_draft_model: ClassVar[bool] = True
  config: ModelConfig = flax.struct.field(pytree_node=False)
  params: Params
  head: DraftHead | None = None
  stop_threshold: float = flax.struct.field(pytree_node=False, default=0.0)  # in [0, 1); 0 = off
  cache_sharding: Any = flax.struct.field(pytree_node=False, default=None)  # the draft cache's placement on a mesh
  # Draft this static tree, or a dynamic tree of this budget, each round; None = a chain.
  tree: Tree | DynamicSpec | None = flax.struct.field(pytree_node=False, default=None)
  tree_children: str = flax.struct.field(pytree_node=False, default="iid")  # `tree_drafting.CHILDREN`

  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    group = add_vocab_options(ml_collections.ConfigDict())
    group.stop_threshold = 0.0  # a row stops drafting when the draft's top probability falls below this
    #                             (0 = off; in [0, 1))
    return group

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    if not settings.draft:
      raise ConfigError("config.draft is empty but config.drafter is 'model' (or choose drafter 'ngram' or "
                        "'layer_skip', which need no draft model)")
    check_vocab_options(settings.options, settings.group)
    error = _settings_error(settings.options.stop_threshold, settings.tree, settings.tree_children)
    if error:
      raise ConfigError(f"config.{'model.' if error.startswith('stop') else ''}{error}")

  @classmethod
  def build(cls, settings: DrafterSettings, target: LoadedModel, draft: LoadedModel | None,
            log: Callable[[str], None] = print) -> tuple[ModelDrafter, dict]:
    if draft is None:
      raise ValueError("drafter 'model' needs a loaded draft model")
    check_compatible(target, draft)
    head, coverage = restricted_draft_head(settings.options.vocab, settings.options.vocab_corpus, target, draft,
                                           log)
    drafter = cls(draft.config, draft.params, head, stop_threshold=settings.options.stop_threshold,
                  cache_sharding=partitioning.cache_sharding(draft.config, draft.part), tree=settings.tree, tree_children=settings.tree_children)
    return drafter, {"draft_vocab_coverage": coverage}

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def cache_config(self) -> ModelConfig:
    return self.config

  def verify_widths(self, k: int) -> tuple[int, ...]:
    return short_proposal_widths(k) if self.stop_threshold else (k + 1,)

  def check(self, target_config: ModelConfig) -> None:
    error = _settings_error(self.stop_threshold, self.tree, self.tree_children)
    if error:
      raise ValueError(error)
    if self.head is not None and self.head.weight_VdxD.shape[1] != self.config.d_model:
      raise ValueError(f"draft_head rows have width {self.head.weight_VdxD.shape[1]}, the draft's "
                       f"d_model is {self.config.d_model}: restrict the draft's own head")

  def draft_pass(self) -> DraftPass:
    return DraftPass(self.config, self.params, self.head)

  def lookahead(self, k: int) -> int:
    """The draft runs at most K tokens past the point where the target's block starts (a tree: writes
    its N + 1 nodes from there)."""
    return k - 1 if self.tree is None else self.tree.draft_slots - 2

  def _embeddable(self, tokens: jax.Array) -> jax.Array:
    """`tokens` with ids beyond the draft's vocabulary replaced by its last id: `jnp.take` would embed
    them as NaN, which would poison the draft's cache (any finite guess keeps the rule exact)."""
    return jnp.minimum(tokens, self.config.vocab_size - 1)

  def init(self, storage: KVCache, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
           target_cache: KVCache) -> ModelDraftState:
    batch = prompts_BxP.shape[0]
    cache = storage.replace(lengths=jnp.zeros((batch,), jnp.int32))  # whatever it held before
    _, cache = prefill(self.config, self.params, self._embeddable(prompts_BxP), prompt_lengths_B, cache)
    return ModelDraftState(cache=cache, lagging_token=jnp.zeros((batch,), jnp.int32),
                           behind=jnp.zeros((batch,), bool), fed=jnp.int32(0),
                           node_slots=(jnp.zeros((batch, self.tree.nodes_with_root), jnp.int32)
                                       if isinstance(self.tree, DynamicSpec) else None))

  def _catch_up(self, state: ModelDraftState, pending_B: jax.Array) -> tuple[jax.Array, KVCache, jax.Array]:
    """The first pass of a proposal: [d_K, pending] for rows that are behind, [pending, (unused)] for the
    others; just [pending] when no row is behind (a 2-token pass costs up to 1.8 single ones on a CPU).
    Returns the hidden state after pending [B, D], the cache written (not advanced) and the tokens fed
    per row [B] (1 or 2)."""
    num_valid_B = 1 + state.behind.astype(jnp.int32)
    fed_pending_B = self._embeddable(pending_B)  # the draft's own tokens (d_i, lagging_token) always are

    def two_tokens(cache):
      chunk_Bx2 = jnp.stack([jnp.where(state.behind, state.lagging_token, fed_pending_B), fed_pending_B],
                            axis=1)
      hidden_Bx2xD, cache = forward_hidden(self.config, self.params, chunk_Bx2, cache)
      return cache, jnp.take_along_axis(hidden_Bx2xD, (num_valid_B - 1)[:, None, None], axis=1)[:, 0]

    def one_token(cache):
      hidden_Bx1xD, cache = forward_hidden(self.config, self.params, fed_pending_B[:, None], cache)
      return cache, hidden_Bx1xD[:, 0]

    cache, hidden_BxD = inplace.cond(jnp.any(state.behind), two_tokens, one_token, state.cache)
    return hidden_BxD, cache, num_valid_B

  def propose(self, state: ModelDraftState, target_cache: KVCache, pending_B: jax.Array,
              sampling: SamplingParams, key: jax.Array, k: int, wanted_B: jax.Array | None = None
              ) -> tuple[Proposal, ModelDraftState, KVCache]:
    if isinstance(self.tree, DynamicSpec):
      return (*self._propose_dynamic_tree(state, pending_B, sampling), target_cache)
    if self.tree is not None:
      proposal, state = self._propose_tree(state, pending_B, sampling, key)
      return proposal, state, target_cache
    hidden_BxD, cache, num_valid_B = self._catch_up(state, pending_B)

    def draw(hidden_BxD, step_key):
      """(token [B], its distribution [B, V] or None when greedy (a point mass), confident [B])."""
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

    keys_K = jax.random.split(key, k)
    token_B, probs_BxV, confident_B = draw(hidden_BxD, keys_K[0])
    tokens_BxK = jnp.zeros((len(pending_B), k), jnp.int32).at[:, 0].set(token_B)
    # Greedy proposals are point masses: no [B, K, V] buffer.
    probs_BxKxV = None if probs_BxV is None else jnp.zeros(
        (len(pending_B), k, self.vocab_size), jnp.float32).at[:, 0].set(probs_BxV)

    # Then d_i is fed (i = 1 .. K-1) to draw d_{i+1}, while some row is still drafting: a row stops at
    # its first draft token whose distribution's top probability is below `stop_threshold` (that token
    # is not proposed). `fed` counts the draft tokens fed, the same for every row.
    # `confident_BxK` [B, K]: d_1 .. d_i confident (False past the drawn tokens); row b is still drafting
    # while its last drawn token is.
    # The catch-up pass always runs (it feeds the pending token: the cache stays in step even when the
    # policy proposes nothing); the next pass only while some row wants and may still draw a token.
    limit = k if wanted_B is None else jnp.minimum(jnp.max(wanted_B), k)

    def more(carry):
      fed, _, _, _, confident_BxK = carry
      return (fed + 1 < limit) & jnp.any(confident_BxK[:, fed])

    def step(carry):
      fed, cache, tokens_BxK, probs_BxKxV, confident_BxK = carry
      hidden_Bx1xD, cache = forward_hidden(self.config, self.params, tokens_BxK[:, fed, None], cache)
      next_B, probs_BxV, confident_B = draw(hidden_Bx1xD[:, 0], keys_K[fed + 1])
      return (fed + 1, cache.advance(jnp.ones_like(next_B)), tokens_BxK.at[:, fed + 1].set(next_B),
              None if probs_BxV is None else probs_BxKxV.at[:, fed + 1].set(probs_BxV),
              confident_BxK.at[:, fed + 1].set(confident_BxK[:, fed] & confident_B))

    confident_BxK = jnp.zeros((len(pending_B), k), bool).at[:, 0].set(confident_B)
    fed, cache, tokens_BxK, probs_BxKxV, confident_BxK = jax.lax.while_loop(
        more, step, (jnp.int32(0), cache.advance(num_valid_B), tokens_BxK, probs_BxKxV, confident_BxK))
    # Row b proposes its leading confident tokens, at most fed + 1 of them (all K when stopping is off).
    lengths_B = jnp.sum(jnp.cumprod(confident_BxK, axis=1), axis=1).astype(jnp.int32)
    # The cache now holds [d_K?, pending, d_1 .. d_fed] beyond the history, uncommitted.
    proposal = Proposal(tokens=tokens_BxK, lengths=lengths_B, probs=probs_BxKxV, calls=fed + 1)
    return proposal, state.replace(cache=cache.replace(lengths=state.cache.lengths), fed=fed), target_cache

  def _propose_tree(self, state: ModelDraftState, pending_B: jax.Array, sampling: SamplingParams,
                    key: jax.Array) -> tuple[Proposal, ModelDraftState]:
    """A tree proposal (`tree_drafting`) after [history, pending]; the draft cache then holds every node
    beyond the history (uncommitted), for `commit` to compact the accepted path. Never behind."""
    tokens_BxN, probs_BxNxW, cache = draft_tree(self.config, self.params, self.head, self.tree,
                                                self.tree_children, state.cache, self._embeddable(pending_B),
                                                sampling, key)
    proposal = full(tokens_BxN, probs_BxNxW, calls=self.tree.max_depth + 1).replace(tree=self.tree)
    return proposal, state.replace(cache=cache)

  def _propose_dynamic_tree(self, state: ModelDraftState, pending_B: jax.Array,
                            sampling: SamplingParams) -> tuple[Proposal, ModelDraftState]:
    """A dynamic tree (`dynamic_tree`) grown after [history, (lagging token,) pending]: the catch-up pass
    gives the root's distribution, then Dt - 1 frontier chunks. The state keeps the cache at its committed
    length and each node's slot beyond the root, for `commit`."""
    hidden_BxD, cache, num_valid_B = self._catch_up(state, pending_B)
    root_logits_BxW = draft_logits(self.config, self.params, self.head, hidden_BxD)
    tokens_BxN, tree, slots_BxN1, cache = draft_dynamic_tree(self.config, self.params, self.head, self.tree,
                                                             cache.advance(num_valid_B), root_logits_BxW,
                                                             sampling)
    proposal = full(tokens_BxN, calls=self.tree.max_depth).replace(dynamic_tree=tree)
    return proposal, state.replace(cache=cache.replace(lengths=state.cache.lengths), node_slots=slots_BxN1)

  def _commit_dynamic_tree(self, state: ModelDraftState, path_BxDt1: jax.Array, path_tokens_BxDt: jax.Array,
                           num_committed_B: jax.Array) -> ModelDraftState:
    """After a dynamic tree's round the cache holds [(lagging,) root] then the frontier nodes at their
    slots: the accepted nodes a_1 .. a_{n-1} (all expanded, so all fed) move behind the root and a_n,
    perhaps never fed, becomes the lagging token, fed by the next catch-up pass."""
    committed_B = num_committed_B > 0
    accepted_B = jnp.maximum(num_committed_B - 1, 0)
    cache = state.cache.advance(jnp.where(committed_B, 1 + state.behind.astype(jnp.int32), 0))
    if path_BxDt1.shape[1] > 2:  # depth >= 2: some accepted node may have been fed
      sources_BxM = jnp.take_along_axis(state.node_slots, path_BxDt1[:, 1:-1], axis=1)
      cache = cache.compact(jnp.maximum(sources_BxM, 0))
    lagging_B = committed_B & (accepted_B > 0)
    last_accepted_B = jnp.take_along_axis(path_tokens_BxDt, jnp.maximum(accepted_B - 1, 0)[:, None], axis=1)[:, 0]
    return state.replace(cache=cache.advance(jnp.where(committed_B, jnp.maximum(accepted_B - 1, 0), 0)),
                         lagging_token=jnp.where(lagging_B, last_accepted_B, state.lagging_token),
                         behind=jnp.where(committed_B, lagging_B, state.behind))

  def commit(self, state: ModelDraftState, proposal: Proposal, num_committed_B: jax.Array,
             target_hidden_BxK1xD: jax.Array) -> ModelDraftState:
    if isinstance(self.tree, DynamicSpec):  # `proposal` is the accepted path (`Proposal.along`)
      return self._commit_dynamic_tree(state, proposal.path, proposal.tokens, num_committed_B)
    if self.tree is not None:  # `proposal` is the accepted path (`Proposal.along`)
      cache = state.cache if self.tree.is_chain else state.cache.compact(proposal.path)
      return state.replace(cache=cache.advance(num_committed_B))
    committed_B = num_committed_B > 0
    # Written beyond the history: d_K of last round (if behind), pending, d_1 .. d_fed. A row that
    # accepted n > fed draft tokens commits d_n without its keys: it is behind by that one token.
    held_B = jnp.where(committed_B, state.behind + jnp.minimum(num_committed_B, state.fed + 1), 0)
    lagging_B = num_committed_B > state.fed + 1
    last_accepted_B = jnp.take_along_axis(proposal.tokens, jnp.maximum(num_committed_B - 2, 0)[:, None],
                                          axis=1)[:, 0]
    return state.replace(
        cache=state.cache.advance(held_B),
        lagging_token=jnp.where(lagging_B, last_accepted_B, state.lagging_token),
        behind=jnp.where(committed_B, lagging_B, state.behind))
