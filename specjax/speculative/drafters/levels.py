"""Speculation in levels (ML-SpecQD's multi-level drafting): a drafter that is itself an exact speculative
decoder. Its K tokens a round come from a *middle* model, the target's own weights re-quantized (int4 by
default, `quantized.QuantizedDrafter`), which does not draw them one pass at a time: it verifies an
*inner* drafter's proposals (prompt lookup, `ngram.NgramDrafter`) by the loop's own acceptance rule
(`acceptance.verify`, `verify_greedy`), inside `propose`, in the same jitted round.

An inner round: the inner drafter proposes up to m = `inner_k` tokens e_1 .. e_m after the history, the
pending token and the tokens drawn so far; the middle scores [x, e_1 .. e_m] in one pass (x: the newest
drawn token, not yet fed, the pending one in the first round; the narrowest of its passes that holds every
row's proposal, `short_proposal_widths`), and the rule keeps e_1 .. e_n and draws one more token (the
middle's correction, or its bonus). Rounds run (`lax.while_loop`, fixed shapes) until every row has drawn
its K tokens (the plan's, at least one); a row's overshoot is dropped.

Exactness. The inner rule makes each drawn token, given the tokens before it, an exact sample of the
middle's processed distribution at its position (`sampling.probabilities`: the round's temperature,
top-k, top-p and constraint), which the middle's pass that drew it computed: the proposal reports that
distribution as the one d_i was drawn from (`Proposal.probs`). The outer rule keeps the target's
distribution for any drafter that reports, for each token, the distribution it was drawn from given the
tokens before it; so the output follows the target's at any temperature. Greedy: the proposal is the
middle's greedy chain (point masses), and the output is the target's greedy output, token for token.

The middle's cache and commit are the model drafter's (`ModelDrafter` with `max_lag` 1). A row's lag (its
last accepted token, never fed: the last token an inner round drew) leads the row's block in the first
inner pass, [lag, pending, e_1 .. e_{m-1}] (its proposal one token shorter), so catching up costs no pass
of its own. The state's `fed` is per row here ([B]: rows draw their tokens in different inner rounds):
d_1 .. d_fed are in the middle's cache after the pending token, every drawn token but the last.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, ClassVar, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from specjax import inplace
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import forward_hidden
from specjax.sampling import SamplingParams, argmax_tokens, probabilities
from specjax.speculative import acceptance
from specjax.speculative.drafters.base import DraftPass, Drafter, DrafterSettings, short_proposal_widths
from specjax.speculative.drafters.draft_head import draft_inputs, draft_logits
from specjax.speculative.drafters.history import HistoryDrafter, HistoryState, appended
from specjax.speculative.drafters.model import ModelDrafter, ModelDraftState
from specjax.speculative.drafters.ngram import NgramDrafter
from specjax.speculative.drafters.quantized import QuantizedDrafter, check_weights
from specjax.speculative.plan import RoundPlan
from specjax.speculative.proposal import Proposal

if TYPE_CHECKING:
  from specjax.models.load import LoadedModel

INNER = ("ngram",)  # config.levels.inner


@flax.struct.dataclass
class LevelsState:
  middle: ModelDraftState  # the middle's cache and lag (`fed`: [B] int32, per row)
  inner: HistoryState  # the inner drafter's committed history


class _Context(NamedTuple):
  """What every inner round of one proposal reads."""

  history_BxS: jax.Array  # [B, S] int32: the inner drafter's context, the history then the pending token
  lengths_B: jax.Array  # [B] int32: its length
  pending_B: jax.Array  # [B] int32
  lag_B: jax.Array  # [B] int32 in {0, 1}: the middle's lag, fed ahead of the first inner round's block
  lag_id_B: jax.Array  # [B] int32: the lagging id
  sampling: SamplingParams  # its constraint: the state after the pending token
  key: jax.Array
  goal_B: jax.Array  # [B] int32 >= 1: the tokens each row draws


@flax.struct.dataclass
class _Drawn:
  """The inner rounds' carry: what the middle has drawn so far, row by row."""

  cache: KVCache  # [L, B, S, G, Dh] the middle's cache; lengths: the history (but its lag before the first
  #                inner round), pending, d_1 .. d_{n-1}
  counts: jax.Array  # [B] int32: n, tokens drawn (d_1 .. d_n)
  tokens: jax.Array  # [B, K + m] int32: d_1 .. d_n, then room for a round's overshoot
  probs: jax.Array | None  # [B, K + m, W] float32: the middle's distribution each d_i was drawn from; None: greedy
  rounds: jax.Array  # [] int32: inner rounds run


def _inner_k_error(inner_k) -> str | None:
  if int(inner_k) != inner_k or inner_k < 1:
    return f"inner_k must be an integer >= 1, got {inner_k!r}"
  return None


class LevelsDrafter(Drafter):
  """A middle model verifying an inner drafter's proposals by the acceptance rule: K tokens distributed
  exactly as the middle's, reported with its distributions (see the module docstring)."""

  name: ClassVar[str] = "levels"
  middle: ModelDrafter  # the middle level: the target's quantized copy on its own cache (a chain, `max_lag` 1)
  inner: HistoryDrafter  # the inner level: proposes to the middle from the committed tokens (prompt lookup)
  inner_k: int = flax.struct.field(pytree_node=False, default=3)  # m: the most tokens an inner round proposes

  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    group = ml_collections.ConfigDict()
    group.weights = "int4"  # the middle level's weight format (the target's own weights), as config.quantized.weights
    group.inner = "ngram"  # the inner level: "ngram" (prompt lookup with config.ngram's defaults; no model)
    group.inner_k = 3  # the most tokens the inner level proposes per inner round (one middle pass of up to
    #                    inner_k + 1 tokens checks them)
    return group

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    super().check_config(settings)
    check_weights(settings)
    options = settings.options
    if options.inner not in INNER:
      raise ConfigError(f"{settings.field('inner')} must be one of {INNER}, got {options.inner!r}")
    error = _inner_k_error(options.inner_k)
    if error:
      raise ConfigError(f"config.{settings.group}.{error}")

  @classmethod
  def build(cls, settings: DrafterSettings, target: LoadedModel, draft: LoadedModel | None,
            log: Callable[[str], None] = print) -> tuple[LevelsDrafter, dict]:
    group = QuantizedDrafter.config_group()
    group.weights = settings.options.weights
    middle, facts = QuantizedDrafter.build(
        DrafterSettings(settings.group, ml_collections.FrozenConfigDict(group), k=settings.k), target, None, log)
    drafter = cls(middle, NgramDrafter(vocab_size=target.config.vocab_size), inner_k=int(settings.options.inner_k))
    return drafter, {**facts, "levels_inner": f"{settings.options.inner}, {drafter.inner_k} tokens an inner round"}

  @property
  def vocab_size(self) -> int:
    return self.middle.vocab_size

  def check(self, target_config: ModelConfig) -> None:
    error = _inner_k_error(self.inner_k)
    if error:
      raise ValueError(error)
    if self.middle.max_lag != 1 or self.middle.tree is not None or self.middle.spelling is not None:
      raise ValueError("the middle level must be a chain model drafter with max_lag 1 and the target's tokenizer")
    if self.inner.tree is not None:
      raise ValueError(f"the inner level proposes chains to the middle, not the tree {self.inner.tree}")
    self.middle.check(target_config)
    self.inner.check(target_config)

  def draft_pass(self) -> DraftPass:
    return self.middle.draft_pass()

  def storage(self, batch_size: int, max_len: int) -> tuple[KVCache, Any]:
    return self.middle.storage(batch_size, max_len), self.inner.storage(batch_size, max_len)

  def check_fits(self, storage: tuple[KVCache, Any], prompt_lengths_B: np.ndarray, max_new_tokens: int, k: int) -> None:
    """The middle writes up to m positions past a chain draft's look-ahead (K - 1 + m); the inner
    context holds up to K - 1 drawn tokens after the pending one."""
    self.middle.check_fits(storage[0], prompt_lengths_B, max_new_tokens, k + self.inner_k)
    self.inner.check_fits(storage[1], prompt_lengths_B, max_new_tokens + k - 1, k)

  def storage_of(self, state: LevelsState) -> tuple[KVCache, Any]:
    return self.middle.storage_of(state.middle), self.inner.storage_of(state.inner)

  def init(self, storage: tuple[KVCache, Any], prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
           target_cache: KVCache) -> LevelsState:
    middle = self.middle.init(storage[0], prompts_BxP, prompt_lengths_B, target_cache)
    return LevelsState(middle.replace(fed=jnp.zeros(prompt_lengths_B.shape, jnp.int32)),
                       self.inner.init(storage[1], prompts_BxP, prompt_lengths_B, target_cache))

  def propose(self, state: LevelsState, target_cache: KVCache, pending_B: jax.Array, sampling: SamplingParams,
              key: jax.Array, plan: RoundPlan) -> tuple[Proposal, LevelsState, KVCache]:
    """Inner rounds until each row has drawn the plan's tokens (at least one: the pending token is always
    fed, as the middle's commit expects); the proposal is each row's first K."""
    middle, k, batch = state.middle, plan.k, pending_B.shape[0]
    context = _Context(*self.inner.context(state.inner, pending_B), pending_B, middle.lag, middle.lag_ids[:, 0],
                       sampling, key, jnp.maximum(plan.clip(jnp.full((batch,), k, jnp.int32)), 1))
    width = k + self.inner_k
    drawn = jax.lax.while_loop(
        lambda drawn: jnp.any(drawn.counts < context.goal_B), functools.partial(self._inner_round, context),
        _Drawn(middle.cache, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, width), jnp.int32),
               None if sampling.greedy else jnp.zeros((batch, width, self.vocab_size), jnp.float32), jnp.int32(0)))
    proposal = Proposal(tokens=drawn.tokens[:, :k], lengths=jnp.minimum(drawn.counts, k),
                        probs=None if drawn.probs is None else drawn.probs[:, :k], calls=drawn.rounds)
    middle = middle.replace(cache=drawn.cache.replace(lengths=middle.cache.lengths),
                            fed=jnp.minimum(drawn.counts - 1, k))
    return proposal, LevelsState(middle, state.inner.replace(pending=pending_B.astype(jnp.int32))), target_cache

  def _inner_round(self, context: _Context, drawn: _Drawn) -> _Drawn:
    """The inner drafter proposes after the tokens drawn so far, the middle checks [x, e_1 .. e_m] in one
    pass (the first round: after the row's lag, if it has one) and the rule draws e_1 .. e_n and one token
    of the middle's; rows that have drawn their goal keep what they hold (their pass writes beyond their
    cache's length)."""
    m = self.inner_k
    active_B = drawn.counts < context.goal_B
    lead_B = jnp.where(drawn.rounds == 0, context.lag_B, 0)
    newest_B = jnp.take_along_axis(drawn.tokens, jnp.maximum(drawn.counts - 1, 0)[:, None], axis=1)[:, 0]
    x_B = jnp.where(drawn.counts > 0, newest_B, context.pending_B)
    offered = self.inner.propose_from_context(
        appended(context.history_BxS, context.lengths_B, drawn.tokens, drawn.counts), context.lengths_B + drawn.counts,
        m)
    offered = offered.replace(lengths=jnp.where(active_B, jnp.minimum(offered.lengths, m - lead_B), 0))
    block_BxM1 = jnp.concatenate([x_B[:, None], offered.tokens], axis=1)  # [x, e_1 .. e_m], or [lag, x, ..]
    block_BxM1 = jnp.where(lead_B[:, None] > 0, jnp.concatenate([context.lag_id_B[:, None], block_BxM1[:, :m]], axis=1),
                           block_BxM1)
    widths = short_proposal_widths(m) if self.middle.config.narrow_passes else (m + 1,)
    scoring = functools.partial(self._score, block_BxM1, lead_B, offered,
                                context.sampling.after(drawn.tokens, drawn.counts),
                                jax.random.fold_in(context.key, drawn.rounds))
    cache, (accepted_B, next_B,
            probs_BxM1xW) = inplace.switch(jnp.searchsorted(jnp.asarray(widths),
                                                            jnp.max(lead_B + offered.lengths) + 1),
                                           [functools.partial(scoring, width) for width in widths], drawn.cache)
    emitted_BxM1 = jnp.where(
        jnp.arange(m + 1)[None, :] < accepted_B[:, None], jnp.pad(offered.tokens, ((0, 0), (0, 1))), next_B[:, None])
    count_B = jnp.where(active_B, accepted_B + 1, 0)  # the lag, x and e_1 .. e_n were fed: the cache keeps them
    return drawn.replace(
        cache=cache.advance(jnp.where(active_B, lead_B, 0) + count_B), counts=drawn.counts + count_B,
        tokens=appended(drawn.tokens, drawn.counts, emitted_BxM1, count_B),
        probs=None if drawn.probs is None else appended(drawn.probs, drawn.counts, probs_BxM1xW, count_B),
        rounds=drawn.rounds + 1)

  def _score(self, block_BxM1: jax.Array, lead_B: jax.Array, offered: Proposal, sampling: SamplingParams,
             key: jax.Array, width: int, cache: KVCache):
    """The middle's pass over each row's first `width` ids of its block, [x, e_1 ..] after `lead_B` ids
    (its lag), and the rule on what follows x in it (`sampling`'s constraint: the state after x).
    Returns (the cache written, not advanced, (accepted [B], the drawn token [B], the middle's
    distributions after x, e_1 .. [B, m + 1, W] zero-padded, None when greedy)): `inplace.switch`'s form."""
    config, params, head = self.middle.config, self.middle.params, self.middle.head
    checked = offered.truncated(width - 1)
    checked = checked.replace(lengths=jnp.minimum(checked.lengths, width - 1 - lead_B))
    hidden_BxWxD, cache = forward_hidden(config, params, draft_inputs(config, head, block_BxM1[:, :width]), cache)
    # The positions from x's on (a leading row's last one repeats: it lies past what the row checks).
    at_BxW = jnp.minimum(lead_B[:, None] + jnp.arange(width)[None, :], width - 1)
    logits_BxWxV = draft_logits(config, params, head, jnp.take_along_axis(hidden_BxWxD, at_BxW[:, :, None], axis=1))
    # Position i's distribution is masked by the constraint's state after [x, e_1 .. e_i].
    scoring = sampling.replace(constraint=sampling.constraint.along(checked.tokens))
    if sampling.greedy:
      return cache, (*acceptance.verify_greedy(checked, argmax_tokens(logits_BxWxV, scoring)), None)
    probs_BxWxV = probabilities(logits_BxWxV, scoring)
    accepted_B, next_B = acceptance.verify(key, checked, probs_BxWxV)
    return cache, (accepted_B, next_B, jnp.pad(probs_BxWxV, ((0, 0), (0, self.inner_k + 1 - width), (0, 0))))

  def commit(self, state: LevelsState, proposal: Proposal, num_committed_B: jax.Array,
             target_features_BxK1xF: jax.Array) -> LevelsState:
    return LevelsState(self.middle.commit(state.middle, proposal, num_committed_B, target_features_BxK1xF),
                       self.inner.commit(state.inner, proposal, num_committed_B, target_features_BxK1xF))
