"""Suffix decoding (Oliaro et al., NeurIPS 2025; Snowflake's ArcticInference): a model-free drafter that
continues the context's longest suffix match in everything already generated: the row's own history,
the other rows of its batch (best-of-n and self-consistency samples share most of their text), and a
**pool** of earlier sequences (earlier calls of a `specjax.Decoder`, earlier turns and batches of a run,
an optional warm-start corpus). Its config group is `config.suffix`.

The pool is a device array `pool_P` of P token ids, oldest to newest, with a separator (-1) after each
sequence; it is a pytree field of the drafter, so it is read by the jitted loop like a draft model's
weights and never changes inside a call. After each call the pipeline hands the call's prompts and
outputs to `remember`, which returns the drafter with them appended (oldest tokens evicted first); a
new pool of the same size does not recompile. Inside a call, rows read each other's committed tokens
as they grow: each round searches the corpus [pool_P, -1, row 0's context, -1, row 1's context, ...].

Per row and round (all pure JAX, fixed shapes, traced in the loop):
1. Match: the longest n <= `max_match` such that the context's last n tokens (its history and the
   pending token) also end at some corpus position j whose next token exists (not a separator, not the
   row's own end). One running AND over the n offsets, as the n-gram drafter: O(max_match * B * C)
   comparisons for a corpus of C tokens.
2. Occurrences: the `occurrences` (M) most recent such j (pool order is age; the batch comes last), by
   `lax.top_k` over the corpus.
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
matches rarer than M); a sequence cut by eviction keeps its newest part; the corpus search is linear
in C, so each round pays for the pool's capacity (`experiments/benchmark_suffix.py` times it per pool
size).
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
from specjax.speculative.proposal import Proposal
from specjax.speculative.trees.tree import Tree

SEPARATOR = -1  # ends every sequence in the corpus; equal to no token, so no match crosses it
_BEYOND = -2  # a suffix token past the context's start: equal to nothing at all


def empty_pool(capacity: int) -> jax.Array:
  """A pool of `capacity` tokens holding nothing: [P] int32, all separators."""
  return jnp.full((capacity,), SEPARATOR, jnp.int32)


@jax.jit
def appended(pool_P: jax.Array, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array, tokens_BxO: jax.Array,
             counts_B: jax.Array) -> jax.Array:
  """`pool_P` with each row's prompt then output (its first `counts_B[b]` tokens) appended, row by row,
  each followed by a separator; the oldest tokens fall off the front. A row of zero length adds nothing."""
  batch, width = prompts_BxP.shape
  sequences_BxW = jnp.concatenate([prompts_BxP, tokens_BxO], axis=1).astype(jnp.int32)
  column_1xW = jnp.arange(sequences_BxW.shape[1])[None, :]
  in_prompt_BxW = column_1xW < prompt_lengths_B[:, None]
  output_column_BxW = column_1xW - width
  in_output_BxW = (output_column_BxW >= 0) & (output_column_BxW < counts_B[:, None])
  sizes_B = prompt_lengths_B + counts_B
  rows_used_B = sizes_B > 0
  starts_B = jnp.cumsum(jnp.where(rows_used_B, sizes_B + 1, 0)) - jnp.where(rows_used_B, sizes_B + 1, 0)
  # Where each token lands in the appended block: its row's start plus its index in prompt + output.
  index_BxW = jnp.where(in_prompt_BxW, column_1xW, prompt_lengths_B[:, None] + output_column_BxW)
  block = batch * (sequences_BxW.shape[1] + 1)
  slots_BxW = jnp.where(in_prompt_BxW | in_output_BxW, starts_B[:, None] + index_BxW, block)
  block_F = jnp.full((block,), SEPARATOR, jnp.int32).at[slots_BxW].set(sequences_BxW, mode="drop")
  used = jnp.sum(jnp.where(rows_used_B, sizes_B + 1, 0))
  capacity = pool_P.shape[0]
  return jax.lax.dynamic_slice(jnp.concatenate([pool_P, block_F]), (used,), (capacity,))


def corpus_of(pool_P: jax.Array, context_BxS: jax.Array, context_lengths_B: jax.Array,
              across_rows: bool) -> jax.Array:
  """The searched corpus, [pool, -1, row 0, -1, row 1, -1, ...] ([C]): every row's context (history and
  pending token) followed by separators up to S + 1 tokens; without `across_rows`, one corpus per row,
  [pool, -1, its own context] ([B, C])."""
  batch, width = context_BxS.shape
  rows_BxS1 = jnp.pad(jnp.where(jnp.arange(width)[None, :] < context_lengths_B[:, None], context_BxS, SEPARATOR),
                      ((0, 0), (0, 1)), constant_values=SEPARATOR)
  head = jnp.concatenate([pool_P, jnp.full((1,), SEPARATOR, jnp.int32)])
  if across_rows:
    return jnp.concatenate([head, rows_BxS1.reshape(-1)])
  return jnp.concatenate([jnp.broadcast_to(head, (batch, head.shape[0])), rows_BxS1], axis=1)


def _rows(corpus: jax.Array) -> jax.Array:
  """The corpus as [B or 1, C]: shared by every row, or one per row."""
  return corpus[None, :] if corpus.ndim == 1 else corpus


def _gather(corpus: jax.Array, index_BxX: jax.Array) -> jax.Array:
  """corpus[index] per row ([B, X]), from the shared corpus [C] or the rows' own [B, C]."""
  return corpus[index_BxX] if corpus.ndim == 1 else jnp.take_along_axis(corpus, index_BxX, axis=1)


def longest_occurrences(corpus: jax.Array, suffix_BxN: jax.Array, max_match: int,
                        occurrences: int) -> tuple[jax.Array, jax.Array]:
  """Each row's longest suffix match: `suffix_BxN[b, m]` is its context's token m places before the end
  (`_BEYOND` past its start); the match length n <= max_match is the largest for which some corpus
  position j, followed by a token, ends a window equal to the last n tokens. Returns (n [B] int32,
  0 = none; ends [B, M] int32: the M = min(occurrences, C) latest such j, -1 where fewer exist)."""
  corpus_RxC = _rows(corpus)
  width = corpus_RxC.shape[1]
  continued_RxC = jnp.pad(corpus_RxC[:, 1:], ((0, 0), (0, 1)), constant_values=SEPARATOR) >= 0
  matches_BxC = jnp.broadcast_to(continued_RxC, (suffix_BxN.shape[0], width))
  best_BxC, length_B = jnp.zeros_like(matches_BxC), jnp.zeros(suffix_BxN.shape[:1], jnp.int32)
  for m in range(max_match):
    shifted_RxC = jnp.pad(corpus_RxC, ((0, 0), (m, 0)), constant_values=SEPARATOR)[:, :width]  # [., j] = c[j - m]
    matches_BxC = matches_BxC & (shifted_RxC == suffix_BxN[:, m:m + 1])
    found_B = jnp.any(matches_BxC, axis=1)
    best_BxC = jnp.where(found_B[:, None], matches_BxC, best_BxC)
    length_B = jnp.where(found_B, m + 1, length_B)
  position_1xC = jnp.arange(width, dtype=jnp.int32)[None, :]
  latest_BxM, _ = jax.lax.top_k(jnp.where(best_BxC, position_1xC, -1), min(occurrences, width))
  return length_B, latest_BxM


def walk(continuations_BxMxK: jax.Array, branches: int, limit_B: jax.Array,
         min_prob: float) -> tuple[jax.Array, jax.Array]:
  """The suffix tree's most frequent paths through M occurrences, whose next K tokens are
  `continuations_BxMxK` (negative: the occurrence's sequence has ended; occurrences listed latest first,
  so the lower index wins a tie). Branch r starts with the r-th most frequent first token (one no
  earlier branch took) and then follows the most frequent token among the occurrences still on its
  path, while the product of the estimates count(token) / count(continuing) stays >= `min_prob` and
  fewer than `limit_B` tokens are proposed. Returns (tokens [B, R, K] int32, lengths [B, R] int32)."""
  batch, m, k = continuations_BxMxK.shape
  recency_1x1xM = (m - jnp.arange(m))[None, None, :]

  def most_frequent(alive_BxRxM, tokens_BxRxM):
    """Per branch: the token most occurrences on the path continue with, its count, and how many continue."""
    usable_BxRxM = alive_BxRxM & (tokens_BxRxM >= 0)
    same_BxRxMxM = (tokens_BxRxM[..., :, None] == tokens_BxRxM[..., None, :]) & usable_BxRxM[..., None, :]
    count_BxRxM = jnp.where(usable_BxRxM, jnp.sum(same_BxRxMxM, axis=-1), 0)
    chosen_BxR = jnp.argmax(count_BxRxM * (m + 1) + recency_1x1xM, axis=-1)
    pick = lambda a: jnp.take_along_axis(a, chosen_BxR[..., None], axis=-1)[..., 0]
    return pick(tokens_BxRxM), pick(count_BxRxM), jnp.sum(usable_BxRxM, axis=-1)

  # Depth 0: the branches' distinct first tokens, ranked.
  first_BxM = continuations_BxMxK[:, :, 0]
  alive_BxM = first_BxM >= 0
  heads, head_counts = [], []
  for _ in range(branches):
    token_Bx1, count_Bx1, _ = most_frequent(alive_BxM[:, None, :], first_BxM[:, None, :])
    heads.append(token_Bx1[:, 0])
    head_counts.append(count_Bx1[:, 0])
    alive_BxM = alive_BxM & (first_BxM != token_Bx1)
  token_BxR, count_BxR = jnp.stack(heads, axis=1), jnp.stack(head_counts, axis=1)
  continuing_BxR = jnp.broadcast_to(jnp.sum(first_BxM >= 0, axis=1)[:, None], token_BxR.shape)
  alive_BxRxM = first_BxM[:, None, :] == token_BxR[:, :, None]
  prob_BxR = jnp.ones(token_BxR.shape, jnp.float32)
  going_BxR = jnp.ones(token_BxR.shape, bool)
  tokens, lengths_BxR = [], jnp.zeros(token_BxR.shape, jnp.int32)
  for d in range(k):
    if d:
      next_BxRxM = jnp.broadcast_to(continuations_BxMxK[:, None, :, d], alive_BxRxM.shape)
      token_BxR, count_BxR, continuing_BxR = most_frequent(alive_BxRxM, next_BxRxM)
      alive_BxRxM = alive_BxRxM & (next_BxRxM == token_BxR[:, :, None])
    prob_BxR = prob_BxR * count_BxR / jnp.maximum(continuing_BxR, 1)
    going_BxR = going_BxR & (count_BxR > 0) & (prob_BxR >= min_prob) & (d < limit_B[:, None])
    lengths_BxR = lengths_BxR + going_BxR
    tokens.append(jnp.where(going_BxR, token_BxR, 0))  # an unproposed slot still holds a valid id
  return jnp.stack(tokens, axis=2).astype(jnp.int32), lengths_BxR


def _settings_error(s) -> str | None:
  """What is wrong with the group's settings (None when nothing is), as "field: message"."""
  checks = (("max_match", int(s.max_match) == s.max_match and s.max_match >= 1, "an integer >= 1"),
            ("occurrences", int(s.occurrences) == s.occurrences and s.occurrences >= 1, "an integer >= 1"),
            ("factor", s.factor >= 0, ">= 0"),
            ("min_prob", 0 <= s.min_prob <= 1, "in [0, 1]"),
            ("pool_tokens", int(s.pool_tokens) == s.pool_tokens and s.pool_tokens >= 0, "an integer >= 0"),
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
  pool: jax.Array | None = None  # [P] int32: earlier sequences, oldest first, each followed by SEPARATOR; None = none
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
    pool = empty_pool(int(o.pool_tokens))
    info = {"pool_tokens": int(o.pool_tokens)}
    if o.corpus:
      pool, warmed = warm_pool(pool, o.corpus, target.tokenizer.encode, int(o.corpus_tokens) or int(o.pool_tokens))
      info["pool_corpus_tokens"] = warmed
      log(f"suffix pool: {warmed} tokens of {o.corpus}")
    return cls(vocab_size=target.config.vocab_size, pool=pool, tree=settings.tree, **cls.search_fields(o)), info

  @staticmethod
  def search_fields(options) -> dict:
    """The drafter's static fields set by its config group (the pool's settings are `build`'s)."""
    return {"max_match": int(options.max_match), "occurrences": int(options.occurrences),
            "factor": float(options.factor), "offset": float(options.offset), "min_prob": float(options.min_prob),
            "across_rows": bool(options.across_rows)}

  def __post_init__(self):
    if self.tree is not None and not is_spines(self.tree):
      raise ValueError(f"tree {self.tree}: the suffix drafter drafts spines, (b, 1, ..., 1)")

  @property
  def pool_P(self) -> jax.Array:
    """The pool, [P] int32 (P = 0 without one)."""
    return empty_pool(0) if self.pool is None else self.pool

  def remember(self, prompts_BxP, prompt_lengths_B, tokens_BxO, counts_B) -> SuffixDrafter:
    if not self.pool_P.shape[0]:
      return self
    return self.replace(pool=appended(self.pool_P, prompts_BxP, prompt_lengths_B, tokens_BxO, counts_B))

  def forget(self) -> SuffixDrafter:
    return self.replace(pool=empty_pool(self.pool_P.shape[0]))

  def propose_from_context(self, context_BxS: jax.Array, context_lengths_B: jax.Array, k: int) -> Proposal:
    branches = 1 if self.tree is None else len(self.tree.children(0))
    tokens_BxRxK, lengths_BxR = self.continuations(context_BxS, context_lengths_B, k, branches)
    if self.tree is None:
      return Proposal(tokens=tokens_BxRxK[:, 0], lengths=lengths_BxR[:, 0])
    return spines(tokens_BxRxK, lengths_BxR, self.vocab_size, self.tree)

  def continuations(self, context_BxS: jax.Array, context_lengths_B: jax.Array, k: int,
                    branches: int) -> tuple[jax.Array, jax.Array]:
    """([B, R, K] the walk's tokens for R branches, [B, R] how many of them are proposed)."""
    corpus = corpus_of(self.pool_P, context_BxS, context_lengths_B, self.across_rows)
    offset_N = jnp.arange(self.max_match)
    suffix_index_BxN = context_lengths_B[:, None] - 1 - offset_N[None, :]
    suffix_BxN = jnp.where(suffix_index_BxN >= 0,
                           jnp.take_along_axis(context_BxS, jnp.maximum(suffix_index_BxN, 0), axis=1), _BEYOND)
    match_B, ends_BxM = longest_occurrences(corpus, suffix_BxN, self.max_match, self.occurrences)
    positions_BxMxK = ends_BxM[:, :, None] + 1 + jnp.arange(k)[None, None, :]
    found_BxMxK = (ends_BxM[:, :, None] >= 0) & (positions_BxMxK < corpus.shape[-1])
    index_BxMK = jnp.where(found_BxMxK, positions_BxMxK, 0).reshape(len(ends_BxM), -1)
    continuations_BxMxK = jnp.where(found_BxMxK, _gather(corpus, index_BxMK).reshape(found_BxMxK.shape), SEPARATOR)
    # A separator ends the occurrence's sequence: nothing after it continues the path.
    continuations_BxMxK = jnp.where(jnp.cumsum(continuations_BxMxK < 0, axis=2) > 0, SEPARATOR, continuations_BxMxK)
    limit_B = jnp.minimum(k, jnp.floor(match_B * self.factor + self.offset)).astype(jnp.int32)
    limit_B = jnp.where(match_B > 0, limit_B, 0)
    return walk(continuations_BxMxK, branches, limit_B, self.min_prob)


def warm_pool(pool_P: jax.Array, source: str, encode, budget: int) -> tuple[jax.Array, int]:
  """`pool_P` with the documents of `source` (`specjax.corpus.read_documents`) appended in order, each
  followed by a separator, up to `budget` tokens (the last ones kept); returns it and the tokens added."""
  ids: list[int] = []
  for document in corpora.read_documents(source):
    ids += encode(document.text, add_special_tokens=False) + [SEPARATOR]
    if len(ids) >= budget:
      break
  ids = ids[-min(budget, pool_P.shape[0]):]
  added = np.asarray(ids, np.int32)
  return jnp.concatenate([pool_P, jnp.asarray(added)])[len(added):], int(np.sum(added >= 0))
