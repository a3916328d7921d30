"""Suffix decoding (Oliaro et al., NeurIPS 2025; Snowflake's ArcticInference): a model-free drafter that
continues the context's longest suffix match in everything already generated: the row's own history,
the other rows of its batch (best-of-n and self-consistency samples share most of their text), and a
**pool** of earlier sequences (earlier calls of a `specjax.Decoder`, earlier turns and batches of a run,
an optional warm-start corpus). Its config group is `config.suffix`.

The pool (`suffix_pool.Pool`) holds P token ids, oldest to newest, with a separator (-1) after each
sequence, and their index; it is a pytree field of the drafter, so it is read by the jitted loop like a
draft model's weights and never changes inside a call. After each call the pipeline hands the call's
prompts and outputs to `remember`, which returns the drafter with them appended (oldest tokens evicted
first) and indexed again; a new pool of the same size does not recompile. Inside a call, rows read each
other's committed tokens as they grow: each round searches the corpus [pool, -1, row 0's context, -1,
row 1's context, ...].

Per row and round (all pure JAX, fixed shapes, traced in the loop):
1. Match: the longest n <= `max_match` such that the context's last n tokens (its history and the
   pending token) also end at some corpus position j whose next token exists (not a separator, not the
   row's own end). In the batch's part, one running AND over the n offsets, as the n-gram drafter:
   O(max_match * B * C) comparisons for C = B (S + 1) tokens; in the pool, binary searches of its
   suffix array: O(max_match * B * log P).
2. Occurrences: the `occurrences` (M) most recent such j (pool order is age; the batch comes last): by
   `lax.top_k` over the batch's part, and from O(log P) blocks of the pool index's merge-sort tree.
3. Walk: from the match, token by token (the path of a suffix tree through those occurrences), choose
   the continuation token followed by the most occurrences still on the path (ties: the most recent),
   with the estimate p = (occurrences continuing with it) / (occurrences continuing at all); stop where
   the product of the estimates falls below `min_prob`, where no occurrence continues, or at the
   speculation length min(K, floor(n * `factor` + `offset`)) (SuffixDecoding's `max_spec_factor`,
   `max_spec_offset`, `min_token_prob`). O(K * M^2) per row.
Trees (`tree = (b, 1, ..., 1)`, spines): branch r starts with the r-th ranked first token and continues
as above; the target verifies all branches in one tree-masked pass, like the n-gram drafter's spines.

Exactness needs nothing from the pool: proposals are point masses, verified by the acceptance rule
(accept d with probability q(d), else draw from q without d), so the output follows the target's
distribution at any temperature and equals its greedy output when greedy, whatever the pool holds.

Costs and limits: frequencies are counted over the M most recent occurrences, not all of them (exact for
matches rarer than M); a sequence cut by eviction keeps its newest part; a round's search is linear in
the batch's tokens and logarithmic in the pool's, whose index is rebuilt after each call, O(P log^2 P)
(`experiments/benchmark_suffix.py` times both per pool size).
"""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from specjax import corpus as corpora
from specjax.errors import ConfigError
from specjax.speculative.drafters.base import DrafterSettings
from specjax.speculative.drafters.history import HistoryDrafter, spines
from specjax.speculative.drafters.ngram import is_spines
from specjax.speculative.drafters.suffix_pool import SEPARATOR, Pool, empty_pool
from specjax.speculative.proposal import Proposal
from specjax.speculative.trees.tree import Tree

_BEYOND = -2  # a suffix token past the context's start: equal to nothing at all


def live_corpus(context_BxS: jax.Array, context_lengths_B: jax.Array, across_rows: bool) -> jax.Array:
  """The batch's part of the searched corpus, [-1, row 0, -1, row 1, -1, ...] ([C]): every row's context
  (history and pending token) followed by separators up to S + 1 tokens; without `across_rows`, one
  part per row, [-1, its own context] ([B, C]). The pool comes before it: the corpus is [pool, part]."""
  batch, width = context_BxS.shape
  rows_BxS1 = jnp.pad(jnp.where(jnp.arange(width)[None, :] < context_lengths_B[:, None], context_BxS, SEPARATOR),
                      ((0, 0), (1, 0)), constant_values=SEPARATOR)
  return rows_BxS1.reshape(-1) if across_rows else rows_BxS1


def _rows(corpus: jax.Array) -> jax.Array:
  """The corpus as [B or 1, C]: shared by every row, or one per row."""
  return corpus[None, :] if corpus.ndim == 1 else corpus


def _gather(corpus: jax.Array, index_BxZ: jax.Array) -> jax.Array:
  """corpus[index] per row ([B, Z]), from the shared corpus [C] or the rows' own [B, C]."""
  return corpus[index_BxZ] if corpus.ndim == 1 else jnp.take_along_axis(corpus, index_BxZ, axis=1)


def longest_occurrences(corpus: jax.Array, suffix_BxMt: jax.Array, max_match: int,
                        occurrences: int) -> tuple[jax.Array, jax.Array]:
  """Each row's longest suffix match: `suffix_BxMt[b, m]` is its context's token m places before the end
  (`_BEYOND` past its start); the match length n <= max_match is the largest for which some corpus
  position j, followed by a token, ends a window equal to the last n tokens. Returns (n [B] int32,
  0 = none; ends [B, Oc] int32: the M = min(occurrences, C) latest such j, -1 where fewer exist)."""
  corpus_RxCp = _rows(corpus)
  width = corpus_RxCp.shape[1]
  continued_RxCp = jnp.pad(corpus_RxCp[:, 1:], ((0, 0), (0, 1)), constant_values=SEPARATOR) >= 0
  matches_BxCp = jnp.broadcast_to(continued_RxCp, (suffix_BxMt.shape[0], width))
  best_BxCp, length_B = jnp.zeros_like(matches_BxCp), jnp.zeros(suffix_BxMt.shape[:1], jnp.int32)
  for m in range(max_match):
    shifted_RxCp = jnp.pad(corpus_RxCp, ((0, 0), (m, 0)), constant_values=SEPARATOR)[:, :width]  # [., j] = c[j - m]
    matches_BxCp = matches_BxCp & (shifted_RxCp == suffix_BxMt[:, m:m + 1])
    found_B = jnp.any(matches_BxCp, axis=1)
    best_BxCp = jnp.where(found_B[:, None], matches_BxCp, best_BxCp)
    length_B = jnp.where(found_B, m + 1, length_B)
  position_1xCp = jnp.arange(width, dtype=jnp.int32)[None, :]
  latest_BxOc, _ = jax.lax.top_k(jnp.where(best_BxCp, position_1xCp, -1), min(occurrences, width))
  return length_B, latest_BxOc


def walk(continuations_BxOcxK: jax.Array, branches: int, limit_B: jax.Array,
         min_prob: float) -> tuple[jax.Array, jax.Array]:
  """The suffix tree's most frequent paths through M occurrences, whose next K tokens are
  `continuations_BxOcxK` (negative: the occurrence's sequence has ended; occurrences listed latest first,
  so the lower index wins a tie). Branch r starts with the r-th most frequent first token (one no
  earlier branch took) and then follows the most frequent token among the occurrences still on its
  path, while the product of the estimates count(token) / count(continuing) stays >= `min_prob` and
  fewer than `limit_B` tokens are proposed. Returns (tokens [B, R, K] int32, lengths [B, R] int32)."""
  batch, m, k = continuations_BxOcxK.shape
  recency_1x1xOc = (m - jnp.arange(m))[None, None, :]

  def most_frequent(alive_BxRxOc, tokens_BxRxOc):
    """Per branch: the token most occurrences on the path continue with, its count, and how many continue."""
    usable_BxRxOc = alive_BxRxOc & (tokens_BxRxOc >= 0)
    same_BxRxOcxOc = (tokens_BxRxOc[..., :, None] == tokens_BxRxOc[..., None, :]) & usable_BxRxOc[..., None, :]
    count_BxRxOc = jnp.where(usable_BxRxOc, jnp.sum(same_BxRxOcxOc, axis=-1), 0)
    chosen_BxR = jnp.argmax(count_BxRxOc * (m + 1) + recency_1x1xOc, axis=-1)
    pick = lambda a: jnp.take_along_axis(a, chosen_BxR[..., None], axis=-1)[..., 0]
    return pick(tokens_BxRxOc), pick(count_BxRxOc), jnp.sum(usable_BxRxOc, axis=-1)

  # Depth 0: the branches' distinct first tokens, ranked.
  first_BxOc = continuations_BxOcxK[:, :, 0]
  alive_BxOc = first_BxOc >= 0
  heads, head_counts = [], []
  for _ in range(branches):
    token_Bx1, count_Bx1, _ = most_frequent(alive_BxOc[:, None, :], first_BxOc[:, None, :])
    heads.append(token_Bx1[:, 0])
    head_counts.append(count_Bx1[:, 0])
    alive_BxOc = alive_BxOc & (first_BxOc != token_Bx1)
  token_BxR, count_BxR = jnp.stack(heads, axis=1), jnp.stack(head_counts, axis=1)
  continuing_BxR = jnp.broadcast_to(jnp.sum(first_BxOc >= 0, axis=1)[:, None], token_BxR.shape)
  alive_BxRxOc = first_BxOc[:, None, :] == token_BxR[:, :, None]
  prob_BxR = jnp.ones(token_BxR.shape, jnp.float32)
  going_BxR = jnp.ones(token_BxR.shape, bool)
  tokens, lengths_BxR = [], jnp.zeros(token_BxR.shape, jnp.int32)
  for d in range(k):
    if d:
      next_BxRxOc = jnp.broadcast_to(continuations_BxOcxK[:, None, :, d], alive_BxRxOc.shape)
      token_BxR, count_BxR, continuing_BxR = most_frequent(alive_BxRxOc, next_BxRxOc)
      alive_BxRxOc = alive_BxRxOc & (next_BxRxOc == token_BxR[:, :, None])
    prob_BxR = prob_BxR * count_BxR / jnp.maximum(continuing_BxR, 1)
    going_BxR = going_BxR & (count_BxR > 0) & (prob_BxR >= min_prob) & (d < limit_B[:, None])
    lengths_BxR = lengths_BxR + going_BxR
    tokens.append(jnp.where(going_BxR, token_BxR, 0))  # an unproposed slot still holds a valid id
  return jnp.stack(tokens, axis=2).astype(jnp.int32), lengths_BxR


MAX_POOL_TOKENS = 2**24  # the largest pool (P tokens; `suffix_pool`: [log2 P + 2, P] int32 on the device)


def _settings_error(s) -> str | None:
  """What is wrong with the group's settings (None when nothing is), as "field: message"."""
  checks = (("max_match", int(s.max_match) == s.max_match and s.max_match >= 1, "an integer >= 1"),
            ("occurrences", int(s.occurrences) == s.occurrences and
             s.occurrences >= 1, "an integer >= 1"), ("factor", s.factor
                                                      >= 0, ">= 0"), ("min_prob", 0 <= s.min_prob <= 1, "in [0, 1]"),
            ("pool_tokens", int(s.pool_tokens) == s.pool_tokens and 0 <= s.pool_tokens <= MAX_POOL_TOKENS,
             f"an integer in [0, {MAX_POOL_TOKENS}] (its index holds (log2 P + 2) int32 a token: 1.7 GB at the bound)"),
            ("corpus_tokens", int(s.corpus_tokens) == s.corpus_tokens and s.corpus_tokens >= 0, "an integer >= 0"))
  for name, ok, need in checks:
    if not ok:
      return f"{name} must be {need}, got {s[name]!r}"
  if s.corpus and not s.pool_tokens:
    return f"corpus {s.corpus!r} is set but pool_tokens is 0: the corpus warms the pool, which has no room"
  return None


class SuffixDrafter(HistoryDrafter):
  """Suffix decoding over the row's history, its batch and a pool of earlier sequences (see the module
  docstring)."""

  name: ClassVar[str] = "suffix"
  pool: Pool | None = None  # earlier sequences and their index (`suffix_pool`); None = none
  max_match: int = flax.struct.field(pytree_node=False, default=12)
  occurrences: int = flax.struct.field(pytree_node=False, default=64)
  factor: float = flax.struct.field(pytree_node=False, default=1.0)
  offset: float = flax.struct.field(pytree_node=False, default=0.0)
  min_prob: float = flax.struct.field(pytree_node=False, default=0.1)
  across_rows: bool = flax.struct.field(pytree_node=False, default=True)
  tree: Tree | None = flax.struct.field(pytree_node=False, default=None)  # spines (b, 1, ..., 1); None = a chain

  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    group = ml_collections.ConfigDict()
    group.max_match = 12  # longest suffix of the context matched (each round pays max_match passes over the corpus)
    group.occurrences = 64  # latest occurrences of the match whose continuations are counted (M)
    group.factor = 1.0  # speculation length = min(K, floor(match length * factor + offset)) ...
    group.offset = 0.0  # ... (SuffixDecoding's max_spec_factor and max_spec_offset)
    group.min_prob = 0.1  # stop where the path's estimated probability falls below this (min_token_prob)
    group.pool_tokens = 65536  # pool capacity in tokens (0 = no pool: the row's history and its batch only)
    group.across_rows = True  # rows of a batch read each other's committed tokens
    group.corpus = ""  # warm-start the pool from a corpus ("stdlib", a directory, glob, text or .jsonl file)
    group.corpus_tokens = 0  # tokens of the corpus put in the pool (0 = up to pool_tokens)
    return group

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    error = _settings_error(settings.options)
    if error:
      raise ConfigError(settings.field(error))
    if settings.tree is not None and not is_spines(settings.tree):
      raise ConfigError(f"config.tree {settings.tree}: the suffix drafter drafts spines, (b, 1, ..., 1): its b most "
                        f"frequent first tokens, each continued the tree's depth")

  @classmethod
  def build(cls, settings: DrafterSettings, target, draft, log=print) -> tuple[SuffixDrafter, dict]:
    o = settings.options
    tokens = empty_pool(int(o.pool_tokens))
    info = {"pool_tokens": int(o.pool_tokens)}
    if o.corpus:
      tokens, warmed = warm_pool(tokens, o.corpus, target.tokenizer.encode, int(o.corpus_tokens) or int(o.pool_tokens))
      info["pool_corpus_tokens"] = warmed
      log(f"suffix pool: {warmed} tokens of {o.corpus}")
    pool = Pool.of(tokens, int(o.max_match)) if o.pool_tokens else None
    return cls(vocab_size=target.config.vocab_size, pool=pool, tree=settings.tree, **cls.search_fields(o)), info

  @staticmethod
  def search_fields(options) -> dict:
    """The drafter's static fields set by its config group (the pool's settings are `build`'s)."""
    return {
        "max_match": int(options.max_match), "occurrences": int(options.occurrences), "factor": float(options.factor),
        "offset": float(options.offset), "min_prob": float(options.min_prob), "across_rows": bool(options.across_rows)
    }

  def __post_init__(self):
    if self.tree is not None and not is_spines(self.tree):
      raise ValueError(f"tree {self.tree}: the suffix drafter drafts spines, (b, 1, ..., 1)")
    if self.pool is not None and self.pool.width != self.max_match:
      raise ValueError(f"the pool is indexed for matches of {self.pool.width} tokens, the drafter's max_match "
                       f"is {self.max_match}: build it with Pool.of(tokens, max_match)")

  def remember(self, prompts_BxP, prompt_lengths_B, tokens_BxO, counts_B) -> SuffixDrafter:
    if self.pool is None:
      return self
    return self.replace(pool=self.pool.appended(prompts_BxP, prompt_lengths_B, tokens_BxO, counts_B))

  def forget(self) -> SuffixDrafter:
    return self if self.pool is None else self.replace(pool=Pool.of(empty_pool(self.pool.capacity), self.max_match))

  def propose_from_context(self, context_BxS: jax.Array, context_lengths_B: jax.Array, k: int) -> Proposal:
    branches = 1 if self.tree is None else len(self.tree.children(0))
    tokens_BxRxK, lengths_BxR = self.continuations(context_BxS, context_lengths_B, k, branches)
    if self.tree is None:
      return Proposal(tokens=tokens_BxRxK[:, 0], lengths=lengths_BxR[:, 0])
    return spines(tokens_BxRxK, lengths_BxR, self.vocab_size, self.tree)

  def continuations(self, context_BxS: jax.Array, context_lengths_B: jax.Array, k: int,
                    branches: int) -> tuple[jax.Array, jax.Array]:
    """([B, R, K] the walk's tokens for R branches, [B, R] how many of them are proposed)."""
    offset_Mt = jnp.arange(self.max_match)
    suffix_index_BxMt = context_lengths_B[:, None] - 1 - offset_Mt[None, :]
    suffix_BxMt = jnp.where(suffix_index_BxMt >= 0,
                            jnp.take_along_axis(context_BxS, jnp.maximum(suffix_index_BxMt, 0), axis=1), _BEYOND)
    live = live_corpus(context_BxS, context_lengths_B, self.across_rows)
    match_B, ends_BxOc = longest_occurrences(live, suffix_BxMt, self.max_match, self.occurrences)
    if self.pool is not None:  # the corpus is [pool, live]: the batch's occurrences are the latest
      ends_BxOc = jnp.where(ends_BxOc >= 0, ends_BxOc + self.pool.capacity, -1)
      match_B, ends_BxOc = _longer(match_B, ends_BxOc, *self.pool.search(suffix_BxMt, self.occurrences))
    continuations_BxOcxK = self._following(live, ends_BxOc, k)
    limit_B = jnp.minimum(k, jnp.floor(match_B * self.factor + self.offset)).astype(jnp.int32)
    limit_B = jnp.where(match_B > 0, limit_B, 0)
    return walk(continuations_BxOcxK, branches, limit_B, self.min_prob)

  def _following(self, live: jax.Array, ends_BxOc: jax.Array, k: int) -> jax.Array:
    """The K tokens after each occurrence in the corpus [pool, live] ([B, M, K]; SEPARATOR from the end
    of its sequence on)."""
    pool_tokens = 0 if self.pool is None else self.pool.capacity
    positions_BxOcxK = ends_BxOc[:, :, None] + 1 + jnp.arange(k)[None, None, :]
    found_BxOcxK = (ends_BxOc[:, :, None] >= 0) & (positions_BxOcxK < pool_tokens + live.shape[-1])
    in_pool_BxOcxK = positions_BxOcxK < pool_tokens
    live_index_BxOcxK = jnp.where(found_BxOcxK & ~in_pool_BxOcxK, positions_BxOcxK - pool_tokens, 0)
    live_index_BxZ = live_index_BxOcxK.reshape(len(ends_BxOc), -1)
    following_BxOcxK = _gather(live, live_index_BxZ).reshape(found_BxOcxK.shape)
    if self.pool is not None:
      pooled_BxOcxK = self.pool.tokens[jnp.clip(positions_BxOcxK, 0, pool_tokens - 1)]
      following_BxOcxK = jnp.where(in_pool_BxOcxK, pooled_BxOcxK, following_BxOcxK)
    following_BxOcxK = jnp.where(found_BxOcxK, following_BxOcxK, SEPARATOR)
    # A separator ends the occurrence's sequence: nothing after it continues the path.
    return jnp.where(jnp.cumsum(following_BxOcxK < 0, axis=2) > 0, SEPARATOR, following_BxOcxK)


def _longer(match_B, ends_BxOc, other_match_B, other_ends_BxOc) -> tuple[jax.Array, jax.Array]:
  """The longer of two searches' matches (both where equal) and the M latest of its occurrences."""
  match = jnp.maximum(match_B, other_match_B)
  keep = lambda n_B, e_BxOc: jnp.where(((n_B == match) & (match > 0))[:, None], e_BxOc, -1)
  both_BxC = jnp.concatenate([keep(match_B, ends_BxOc), keep(other_match_B, other_ends_BxOc)], axis=1)
  return match, jax.lax.top_k(both_BxC, ends_BxOc.shape[1])[0]


def warm_pool(pool_Pl: jax.Array, source: str, encode, budget: int) -> tuple[jax.Array, int]:
  """`pool_Pl` with the documents of `source` (`specjax.corpus.read_documents`) appended in order, each
  followed by a separator, up to `budget` tokens (the last ones kept); returns it and the tokens added."""
  ids: list[int] = []
  for document in corpora.read_documents(source):
    ids += encode(document.text, add_special_tokens=False) + [SEPARATOR]
    if len(ids) >= budget:
      break
  ids = ids[-min(budget, pool_Pl.shape[0]):]
  added = np.asarray(ids, np.int32)
  return jnp.concatenate([pool_Pl, jnp.asarray(added)])[len(added):], int(np.sum(added >= 0))
