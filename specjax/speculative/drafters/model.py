"""The model drafter: a small language model with its own static KV cache, sampled autoregressively.

Its forward passes feed each draft token d_1 .. d_{K-1} once, so after a round that accepted all K
tokens the cache lacks d_K (never fed). The cache may trail the committed history by a few ids, the
*lag* (`ModelDraftState.lag_ids`): the next proposal's first pass, the catch-up, feeds [lag, pending]
(e.g. the two-token chunk [d_K, pending]) and reads the logits at the last valid position of each row:
K forward passes per proposal, never an extra pass just to catch up (and a 1-token first pass when
no row lags). Only the position a pass samples from goes through the output head.

Plain rounds skip the draft (`max_lag` other than 1; `build` sets None, the whole history, for the
adaptive K policy, chains and static trees): a round in which no row wants a draft token (the policy
chose 0, a plain target step) runs no draft pass at all and the pending token joins the lag instead; the
first round that drafts again, or the round whose pending ids would overflow a bounded lag, feeds the
whole lag in catch-up passes of up to LAG_CHUNK ids (a pass of several ids costs far less than as many
one-id passes: a plain stretch pays a fraction of a draft pass per round, instead of a whole one). With
the whole history as its lag the draft starts empty: the prompt is the first lag, fed by the first round
that drafts, so a call whose rounds are all plain runs the draft not once.

Early stopping (`stop_threshold` > 0, HF's `assistant_confidence_threshold`): a row proposes its draft
tokens only while the top probability of the draft's own distribution (softmax of its logits, before
temperature, top-k and top-p) reaches the threshold; the first unconfident
token and everything after it are not proposed (never accepted). Once no row is drafting the proposal
stops (fewer draft passes), and the loop verifies with the narrowest pass that holds the longest live
proposal (`verify_widths`). Exactness is unchanged: what is proposed was drawn from p, and a row's
later slots are simply never accepted.

Greedy decoding proposes the argmax tokens as point masses (no [B, K, V] distributions are built).

What a round drafts, a chain or a tree, is its shape's (`model_shapes`: the drafting and the commit of
each); this module holds the draft model and its lag (`_catch_up`, `_lagging`).

`head` (optional) restricts the output head to a frequent subset of the vocabulary (see
`draft_head`): cheaper draft steps, same exactness.

The draft's head may have fewer or more rows than the target's (same tokenizer, padding rows): its
distributions span its own W ids and the acceptance rule extends the smaller side with zeros. Ids the
draft cannot embed (W <= id < V: prompt tokens or target draws there) are fed to it as its last id
(`draft_inputs`): its guesses after them may be poor, never inexact.

A draft with another tokenizer (`spelling` set, `head` an `intersection_head`) drafts through the
token-level intersection (`spelling`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from specjax import inplace, partitioning
from specjax.errors import ConfigError
from specjax.models import quantized
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Params, feed_rows, forward_hidden, hidden_after, prefill
from specjax.speculative.drafters.base import DraftPass, DrafterSettings, ModelBackedDrafter, short_proposal_widths
from specjax.speculative.drafters.draft_head import (DraftHead, add_vocab_options, check_vocab_options, draft_inputs,
                                                     restricted_draft_head)
from specjax.speculative.drafters.model_shapes import ModelShapes
from specjax.speculative.drafters.spelling import Spelling, intersection_drafting, tokenizer_mismatch
from specjax.speculative.trees import shapes
from specjax.speculative.trees.drafting import children_error
from specjax.speculative.trees.dynamic import DynamicSpec
from specjax.speculative.trees.tree import Tree

if TYPE_CHECKING:
  from specjax.models.load import LoadedModel


@flax.struct.dataclass
class ModelDraftState:
  cache: KVCache  # [L, B, S, G, Dh] draft cache: the history but its last `lag` draft ids
  # [B, Λ + M] int32: the draft ids of the history the cache lacks (the first `lag`), oldest first, then
  # room for the pending token's M ids (`_catch_up` writes them there)
  lag_ids: jax.Array
  lag: jax.Array  # [B] int32 in [0, Λ]: how many (accepted but never fed: d_n, pending ids of plain rounds, the prompt)
  fed: jax.Array  # [] int32: draft tokens fed to the draft in the last proposal (K - 1 unless it stopped); [B]
  #                 per row where rows feed different numbers (`levels`)
  pending_ids: jax.Array  # [B] int32: draft ids spelling the last proposal's pending token (1 but with a spelling)
  deferred: jax.Array  # [] bool: the last proposal fed nothing (a plain round): its pending ids join the lag
  spine: jax.Array  # [] bool: the last proposal drew only its tree's spine, as a chain (keys in consecutive slots)
  node_slots: jax.Array | None = None  # [B, N + 1] int32, dynamic trees: each node's cache slot beyond the root


OTHER_TOKENIZER = ("intersect", "refuse")  # config.model.other_tokenizer
# Draft ids per catch-up pass beyond the narrow ones (1 and 2): a lag of n ids costs ceil(n / LAG_CHUNK).
LAG_CHUNK = 32


def lag_for(plain_rounds: bool, config: ModelConfig, tree=None) -> int | None:
  """`ModelDrafter.max_lag`: None (the whole history: plain rounds skip the draft, the prompt included)
  where some rounds propose nothing (`DrafterSettings.plain_rounds`), branches are cheap (the draft's
  narrow passes: CPU) and it drafts chains or static trees; 1 otherwise."""
  return None if plain_rounds and not shapes.of(tree).drawn_each_round and config.narrow_passes else 1


def _settings_error(stop_threshold: float, tree, tree_children: str) -> str | None:
  """What is wrong with the early-stop threshold, the tree and its children (None when nothing is),
  starting with the setting's name ("stop_threshold ...", "tree ...", "tree_children ...")."""
  if not 0.0 <= stop_threshold < 1.0:
    return f"stop_threshold must be in [0, 1) (0 = off), got {stop_threshold}"
  if tree is not None and stop_threshold:
    return "tree and the stop_threshold exclude each other: a tree drafter does not stop early"
  return children_error(tree_children)


class ModelDrafter(ModelShapes, ModelBackedDrafter):
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
  spelling: Spelling | None = None  # another tokenizer's: the target's ids as draft ids (`head` maps back)
  # Λ: draft ids the cache may trail the committed history by (static). 1: only the last accepted token,
  # every round feeds the pending token; more, or None (the whole history, prompt included: the storage's
  # length): rounds proposing nothing skip the draft (needs `config.narrow_passes`: the catch-up passes
  # are compiled at 1, 2 and up to LAG_CHUNK ids, the widest run only while a lag that long waits).
  max_lag: int | None = flax.struct.field(pytree_node=False, default=1)

  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    group = add_vocab_options(ml_collections.ConfigDict())
    group.stop_threshold = 0.0  # a row stops drafting when the draft's top probability falls below this
    #                             (0 = off; in [0, 1))
    group.weights = ""  # the draft model's weight format, as config.weights ("float", "int8", "int4",
    #                     "int4:G", "int4a8", "int4a8:G"); "" = the target's, config.weights
    group.other_tokenizer = "intersect"  # a draft whose tokenizer differs from the target's: "intersect"
    #   drafts through the token-level intersection (the ids whose bytes both vocabularies hold), "refuse"
    #   stops with an error
    return group

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    if not settings.draft:
      raise ConfigError("config.draft is empty but config.drafter is 'model' (or choose drafter 'ngram' or "
                        "'layer_skip', which need no draft model)")
    check_vocab_options(settings.options, settings.group)
    try:
      quantized.parse(settings.options.weights or "float")
    except quantized.FormatError as error:
      raise ConfigError(f"{settings.field('weights')}: {error}") from None
    if settings.options.other_tokenizer not in OTHER_TOKENIZER:
      raise ConfigError(f"config.{settings.group}.other_tokenizer must be one of {OTHER_TOKENIZER}, got "
                        f"{settings.options.other_tokenizer!r}")
    error = _settings_error(settings.options.stop_threshold, settings.tree, settings.tree_children)
    if error:
      raise ConfigError(f"config.{'model.' if error.startswith('stop') else ''}{error}")

  @classmethod
  def build(cls, settings: DrafterSettings, target: LoadedModel, draft: LoadedModel | None,
            log: Callable[[str], None] = print) -> tuple[ModelDrafter, dict]:
    if draft is None:
      raise ValueError("drafter 'model' needs a loaded draft model")
    options, mismatch = settings.options, tokenizer_mismatch(target, draft)
    if mismatch and options.other_tokenizer == "refuse":
      raise ValueError(f"{mismatch} (config.{settings.group}.other_tokenizer is 'refuse')")
    spelling = None
    if mismatch:
      head, spelling, facts = intersection_drafting(target, draft, options.vocab, options.vocab_corpus, log)
    else:
      head, coverage = restricted_draft_head(options.vocab, options.vocab_corpus, target, draft, log)
      facts = {"draft_vocab_coverage": coverage}
    max_lag = lag_for(settings.plain_rounds, draft.config, settings.tree)
    drafter = cls(draft.config, draft.params, head, stop_threshold=options.stop_threshold,
                  cache_sharding=partitioning.cache_sharding(draft.config, draft.part), tree=settings.tree,
                  tree_children=settings.tree_children, spelling=spelling, max_lag=max_lag)
    return drafter, {**facts, "draft_max_lag": "history" if max_lag is None else max_lag}

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size if self.head is None else self.head.vocab_size

  @property
  def cache_config(self) -> ModelConfig:
    return self.config

  def verify_widths(self, k: int) -> tuple[int, ...]:
    return short_proposal_widths(k) if self.stop_threshold else (k + 1,)

  def check(self, target_config: ModelConfig) -> None:
    error = _settings_error(self.stop_threshold, self.tree, self.tree_children)
    if error:
      raise ValueError(error)
    if self.max_lag is not None and (int(self.max_lag) != self.max_lag or self.max_lag < 1):
      raise ValueError(f"max_lag must be an integer >= 1 or None (the whole history), got {self.max_lag}")
    if self.max_lag != 1 and (self.shape.drawn_each_round or not self.config.narrow_passes):
      raise ValueError(f"max_lag {self.max_lag} lets plain rounds skip the draft: it needs a chain or a static "
                       f"tree and the draft's narrow_passes (else every catch-up pass is the widest)")
    if self.head is not None and self.head.weight_VdxD.shape[1] != self.config.d_model:
      raise ValueError(f"draft_head rows have width {self.head.weight_VdxD.shape[1]}, the draft's "
                       f"d_model is {self.config.d_model}: restrict the draft's own head")
    if self.spelling is not None:
      if self.head is None or self.head.inputs_V is None:
        raise ValueError("a draft with a spelling of the target's ids needs an intersection_head")
      if self.spelling.ids_VxM.shape[0] != target_config.vocab_size or self.head.vocab_size != target_config.vocab_size:
        raise ValueError(f"the spelling covers {self.spelling.ids_VxM.shape[0]} ids and the head scores "
                         f"{self.head.vocab_size}, the target has {target_config.vocab_size}")

  @property
  def spelled_ids(self) -> int:
    """M: the most draft ids the draft reads per target token (1 when they share a tokenizer)."""
    return 1 if self.spelling is None else self.spelling.max_ids

  def storage(self, batch_size: int, max_len: int) -> KVCache:
    return super().storage(batch_size, max_len * self.spelled_ids)

  def check_fits(self, storage: KVCache | None, prompt_lengths_B, max_new_tokens: int, k: int) -> None:
    """Every target position may take M draft positions (`spelled_ids`)."""
    m = self.spelled_ids
    super().check_fits(storage, np.asarray(prompt_lengths_B) * m, max_new_tokens * m, k)

  def draft_pass(self) -> DraftPass:
    return DraftPass(self.config, self.params, self.head)

  def lookahead(self, k: int) -> int:
    """The draft runs at most K tokens past the point where the target's block starts (a tree: writes
    its N + 1 nodes from there)."""
    return k - 1 if self.tree is None else self.tree.draft_slots - 2

  def _spell(self, tokens_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The draft ids [B, M] spelling committed target tokens and their counts [B] (1 with a shared
    tokenizer: the token itself, `draft_inputs`)."""
    if self.spelling is None:
      return draft_inputs(self.config, None, tokens_B)[:, None], jnp.ones_like(tokens_B)
    return self.spelling.spell(tokens_B)

  def _feed(self, cache: KVCache, chunk_BxW: jax.Array, num_valid_B: jax.Array,
            narrow: tuple[int, ...]) -> tuple[jax.Array, KVCache, jax.Array]:
    """Feeds each row's first `num_valid_B` ids of `chunk_BxW` in the narrowest of the passes `narrow`
    and W (static; one compiled pass each, 0 = none) that holds every row's, W itself in passes of
    LAG_CHUNK ids when it is wider: on a CPU a 2-token pass costs up to 1.8 single ones, and wider ones
    are rare (a lag of plain rounds, a token spelled by several draft ids); without
    `config.narrow_passes`, always W. Returns the hidden state after each row's last id [B, D] (zeros
    for a row fed nothing), the cache written, not advanced, and the passes run []."""
    batch, width = chunk_BxW.shape
    widths = sorted({w for w in narrow if w < width} | {width}) if self.config.narrow_passes else [width]

    def pass_of(w):
      def run(cache):
        if w == 0:
          return cache, jnp.zeros((batch, self.config.d_model), self.config.jnp_dtype)
        if w > LAG_CHUNK:
          hidden_BxD, fed = feed_rows(self.config, self.params, chunk_BxW, num_valid_B, cache, LAG_CHUNK)
          return fed.replace(lengths=cache.lengths), hidden_BxD
        hidden_BxWxD, cache = forward_hidden(self.config, self.params, chunk_BxW[:, :w], cache)
        return cache, hidden_after(hidden_BxWxD, num_valid_B)

      return run

    needed = jnp.max(num_valid_B)
    cache, hidden_BxD = inplace.switch(sum((needed > w).astype(jnp.int32) for w in widths[:-1]),
                                       [pass_of(w) for w in widths], cache)
    return hidden_BxD, cache, -(-needed // min(width, LAG_CHUNK))

  def init(self, storage: KVCache, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
           target_cache: KVCache) -> ModelDraftState:
    """The draft's state after the prompts: prefilled, or (`max_lag` None) empty with the prompts' draft
    ids as the lag, fed by the first round that drafts."""
    batch = prompts_BxP.shape[0]
    cache = storage.replace(lengths=jnp.zeros((batch,), jnp.int32))  # whatever it held before
    if self.spelling is None:
      ids_BxT, lengths_B = draft_inputs(self.config, None, prompts_BxP), prompt_lengths_B
    else:
      ids_BxT, lengths_B = self.spelling.spell_rows(prompts_BxP, prompt_lengths_B)
    capacity = storage.max_len if self.max_lag is None else self.max_lag
    lag_ids = jnp.zeros((batch, capacity + self.spelled_ids), jnp.int32)
    if self.max_lag is None:
      lag_ids, lag_B = lag_ids.at[:, :ids_BxT.shape[1]].set(ids_BxT), lengths_B
    elif self.spelling is None:
      _, cache = prefill(self.config, self.params, ids_BxT, lengths_B, cache)
      lag_B = jnp.zeros((batch,), jnp.int32)
    else:
      _, cache = feed_rows(self.config, self.params, ids_BxT, lengths_B, cache, self.config.prefill_chunk)
      lag_B = jnp.zeros((batch,), jnp.int32)
    return ModelDraftState(
        cache=cache, lag_ids=lag_ids, lag=lag_B, fed=jnp.int32(0), pending_ids=jnp.ones((batch,), jnp.int32),
        deferred=jnp.bool_(False), spine=jnp.bool_(False), node_slots=(jnp.zeros(
            (batch, self.tree.nodes_with_root), jnp.int32) if self.shape.drawn_each_round else None))

  def _catch_up(self, state: ModelDraftState, pending_B: jax.Array,
                drafting: jax.Array | bool = True) -> tuple[jax.Array, ModelDraftState, KVCache, jax.Array]:
    """The first pass of a proposal: each row's [lag, pending's ids] (`_feed`: just one id when no row
    lags and the tokenizer is shared). When nothing is `drafting` (a plain round) and every row's lag
    has room for pending's ids, nothing is fed (no pass runs, `max_lag` > 1 only): the state then holds
    them as the lag's tail (`lag_ids`), for `commit` to count. Returns the hidden state after pending
    [B, D] (zeros when deferred), the state (`lag_ids`, `pending_ids`, `deferred` set), the cache
    written (not advanced), the ids fed per row [B] and the draft passes that fed them []."""
    spelled_BxM, counts_B = self._spell(pending_B)
    batch, m = spelled_BxM.shape
    capacity = state.lag_ids.shape[1] - m
    # Row b's chunk: its lag ids, then pending's ids right after them.
    slot_BxM = jnp.where(
        jnp.arange(m)[None, :] < counts_B[:, None], state.lag[:, None] + jnp.arange(m)[None, :],
        capacity + m)  # dropped
    chunk_BxW = state.lag_ids.at[jnp.arange(batch)[:, None], slot_BxM].set(spelled_BxM, mode="drop")
    waiting_B = state.lag + counts_B
    deferred = (capacity > 1) & ~jnp.asarray(drafting) & jnp.all(waiting_B <= capacity)
    num_valid_B = jnp.where(deferred, 0, waiting_B)
    hidden_BxD, cache, passes = self._feed(state.cache, chunk_BxW, num_valid_B, (0, 1, 2) if capacity > 1 else (1, 2))
    state = state.replace(lag_ids=chunk_BxW, pending_ids=counts_B, deferred=deferred)
    return hidden_BxD, state, cache, num_valid_B, passes

  def _lagging(self, state: ModelDraftState, committed_B: jax.Array, lagging_B: jax.Array,
               last_accepted_B: jax.Array) -> ModelDraftState:
    """The lag after a round that fed it: the last accepted token (never fed) where `lagging_B`, nothing
    in the other committed rows; rows that committed nothing keep theirs."""
    last_id_B = jnp.where(lagging_B, draft_inputs(self.config, self.head, last_accepted_B), state.lag_ids[:, 0])
    return state.replace(lag_ids=state.lag_ids.at[:, 0].set(last_id_B),
                         lag=jnp.where(committed_B, lagging_B.astype(jnp.int32), state.lag))

  def _deferred_lag(self, state: ModelDraftState, committed_B: jax.Array) -> jax.Array:
    """[B] the lag after a deferred (plain) round, which wrote nothing: pending's ids join it (`_catch_up`
    put them there)."""
    return jnp.where(committed_B, state.lag + state.pending_ids, state.lag)
