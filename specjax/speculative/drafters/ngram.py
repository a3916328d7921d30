"""Prompt lookup decoding: an n-gram drafter that copies what followed an earlier occurrence of the
context's last tokens (Saxena 2023; HF `prompt_lookup_num_tokens`, vLLM's `ngram` method), on device,
inside the jitted loop, with no model and no table: the context is the row's own history.

Each round, per row, the context is the committed history followed by the pending token (L tokens).
For the longest n in [ngram_max .. ngram_min] such that the context's last n tokens also occur
ending at some earlier position j <= L - 2 (so at least one context token follows them; occurrences
may overlap the suffix itself), the drafter proposes the tokens c[j + 1 ..], up to K of them and
never past the end of the context: min(K, L - 1 - j) tokens. A row without a match proposes nothing
(length 0), and a round in which no live row proposes anything runs a single-token target pass
(`verify_widths`: also narrow passes for proposals of 1 to 3 tokens).

Which occurrence: the earliest. Both references do this: HF's `PromptLookupCandidateGenerator` scans
the match indices left to right and takes the first one with a continuation, and vLLM's
`_find_longest_matched_ngram_and_propose_tokens` (a KMP on the reversed context) keeps "the target
n-gram of the earliest position in the original tokens". Matching them makes acceptance rates
comparable with theirs, and the earliest occurrence has the most tokens after it, so its proposal is
never cut shorter by the context's end than any other occurrence's: in a generation that has fallen
into a cycle of period p < K, the latest occurrence offers only p tokens, the earliest offers K. (The
latest would adapt faster when a row's continuation changes after the prompt; that is the trade.)

Trees (`tree = (b, 1, ..., 1)`, spines): branch r continues the r-th best match, ranked by the
longest n, then the earliest position, skipping matches whose next token a better one already
proposes (`ranked_matches`); the target verifies all branches in one tree-masked pass. Slots past a
branch's continuation (or of a branch without a match) hold the id V, which is never accepted.

Exactness: a proposal is a point mass (`Proposal.probs` None: no [B, K, V] tensor is ever built);
the acceptance rule accepts d_i with probability q_i(d_i) and draws a rejection's replacement from q_i
without d_i, so the output follows the target's distribution exactly at any temperature, and greedy
output equals the target's greedy output token for token, whatever is proposed.

Cost per round: O(ngram_max * B * S) elementwise comparisons on the [B, S] history (one running AND
over the n offsets serves every n: the window that matches the last n tokens ending at j is the one
that matches the last n - 1 ending at j and also has c[j - n + 1] = c[L - n]), plus a [B, K] gather.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.sampling import SamplingParams
from specjax.speculative.drafters.base import short_proposal_widths
from specjax.speculative.proposal import Proposal
from specjax.speculative.trees.tree import Tree, from_branching


@flax.struct.dataclass
class NgramState:
  history: jax.Array  # [B, S] int32: committed tokens (prompt, then generated); zeros past `lengths`
  lengths: jax.Array  # [B] int32: committed tokens per row
  pending: jax.Array  # [B] int32: the pending token of the last proposal, the first token commit appends


def _context(state: NgramState, pending_B: jax.Array) -> jax.Array:
  """[B, S]: the history with the pending token written at each row's length. A row whose history
  fills all S positions has no room for it; `check_fits` keeps that from happening to a live row."""
  position_1xS = jnp.arange(state.history.shape[1])[None, :]
  return jnp.where(position_1xS == state.lengths[:, None], pending_B[:, None], state.history)


def ranked_matches(context_BxS: jax.Array, context_lengths_B: jax.Array, ngram_min: int, ngram_max: int,
                   count: int) -> tuple[jax.Array, jax.Array]:
  """For each row's context c = context_BxS[b, :L] (L = context_lengths_B[b]): up to `count` earlier
  positions j <= L - 2 where a suffix of n in [ngram_min, ngram_max] tokens also ends, ranked by the
  longest n, then the earliest j, each with a next token c[j + 1] that no better-ranked one has.
  Returns (found [B, count] bool, j [B, count] int32; 0 where not found)."""
  batch, width = context_BxS.shape
  position_1xS = jnp.arange(width)[None, :]
  longest_BxS = jnp.zeros((batch, width), jnp.int32)  # the longest n matching at each j (0: none)
  # matches_BxS[b, j]: c[j - m] == c[L - 1 - m] for every offset m < n (the window ending at j
  # matches the last n tokens), built one offset at a time.
  matches_BxS = jnp.ones((batch, width), bool)
  for m in range(ngram_max):
    suffix_index_B = jnp.clip(context_lengths_B - 1 - m, 0, width - 1)  # c[L - 1 - m]
    suffix_token_B = jnp.take_along_axis(context_BxS, suffix_index_B[:, None], axis=1)[:, 0]
    shifted_BxS = jnp.pad(context_BxS, ((0, 0), (m, 0)))[:, :width]  # [b, j] = c[j - m] (0 for j < m)
    matches_BxS = matches_BxS & (shifted_BxS == suffix_token_B[:, None])
    n = m + 1
    if n < ngram_min:
      continue
    # The window lies inside the context (j >= n - 1) and a context token follows it (j <= L - 2).
    valid_BxS = matches_BxS & (position_1xS >= n - 1) & (position_1xS <= context_lengths_B[:, None] - 2)
    longest_BxS = jnp.where(valid_BxS, n, longest_BxS)
  next_BxS = jnp.pad(context_BxS[:, 1:], ((0, 0), (0, 1)))  # c[j + 1]
  rank_BxS = jnp.where(longest_BxS > 0, longest_BxS * width + (width - 1 - position_1xS), -1)
  found, ends = [], []
  for _ in range(count):
    end_B = jnp.argmax(rank_BxS, axis=1).astype(jnp.int32)
    found.append(jnp.take_along_axis(rank_BxS, end_B[:, None], axis=1)[:, 0] >= 0)
    ends.append(jnp.where(found[-1], end_B, 0))
    taken_B = jnp.take_along_axis(next_BxS, end_B[:, None], axis=1)
    rank_BxS = jnp.where(next_BxS == taken_B, -1, rank_BxS)  # the same next token: an identical branch head
  return jnp.stack(found, axis=1), jnp.stack(ends, axis=1)


def longest_match(context_BxS: jax.Array, context_lengths_B: jax.Array, ngram_min: int,
                  ngram_max: int) -> tuple[jax.Array, jax.Array]:
  """The best of `ranked_matches`: the longest n in [ngram_min, ngram_max] whose last-n-token suffix
  also ends at an earlier position j <= L - 2, and the earliest such j. Returns (found [B] bool,
  j [B] int32; 0 where not found)."""
  found_Bx1, end_Bx1 = ranked_matches(context_BxS, context_lengths_B, ngram_min, ngram_max, 1)
  return found_Bx1[:, 0], end_Bx1[:, 0]


def is_spines(tree: Tree) -> bool:
  """True for `(b, 1, ..., 1)`: b branches from the root, each a chain of the tree's depth."""
  b = len(tree.children(0))
  return tree == from_branching((b,) + (1,) * (tree.max_depth - 1))


@flax.struct.dataclass
class NgramDrafter:
  """Prompt lookup: proposes what followed the earliest earlier occurrence of the longest matching
  suffix of 1 <= ngram_min <= n <= ngram_max tokens (see the module docstring)."""

  vocab_size: int = flax.struct.field(pytree_node=False)
  ngram_min: int = flax.struct.field(pytree_node=False, default=1)
  ngram_max: int = flax.struct.field(pytree_node=False, default=3)
  tree: Tree | None = flax.struct.field(pytree_node=False, default=None)  # spines (b, 1, ..., 1); None = a chain

  def __post_init__(self):
    if not 1 <= self.ngram_min <= self.ngram_max:
      raise ValueError(f"n-gram sizes need 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min}, "
                       f"ngram_max={self.ngram_max}")
    if self.tree is not None and not (isinstance(self.tree, Tree) and is_spines(self.tree)):
      raise ValueError("tree: the n-gram drafter drafts spines, (b, 1, ..., 1): its b best matches with "
                       "distinct next tokens, each continued the tree's depth")

  def verify_widths(self, k: int) -> tuple[int, ...]:
    return short_proposal_widths(k)  # 1: no live row found a match; the pending token runs alone

  def draft_pass(self) -> None:
    return None  # a lookup: no forward pass, c = 0

  def check(self, target_config: ModelConfig) -> None:
    if self.vocab_size != target_config.vocab_size:
      raise ValueError(f"n-gram drafter vocabulary ({self.vocab_size}) differs from the target's "
                       f"({target_config.vocab_size}): the proposals must be the target's token ids")

  def storage(self, batch_size: int, max_len: int) -> NgramState:
    return NgramState(history=jnp.zeros((batch_size, max_len), jnp.int32),
                      lengths=jnp.zeros((batch_size,), jnp.int32),
                      pending=jnp.zeros((batch_size,), jnp.int32))

  def check_fits(self, storage: NgramState, prompt_lengths_B: np.ndarray, max_new_tokens: int,
                 k: int) -> None:
    """The history must hold a live row's context: at most prompt + budget - 1 tokens. A live row has
    emitted G <= budget - 1 tokens, so its history holds prompt + G - 1 of them and the pending token
    goes at index prompt + G - 1 <= prompt + budget - 2; a row commits only while it stays live, so
    every committed token lands below that bound too (commit drops any write past the end anyway,
    never clamps it onto the history). Only a finished row may lack room for its pending token, and
    nothing it proposes is emitted or committed. This is K positions less than the target's cache
    needs (prompt + budget + K - 1), so storage of the target cache's size always fits."""
    batch, max_len = storage.history.shape
    if batch != len(prompt_lengths_B):
      raise ValueError(f"n-gram history has {batch} rows for {len(prompt_lengths_B)} prompts")
    longest = int(np.max(prompt_lengths_B))
    need = longest + max_new_tokens - 1
    if need > max_len:
      raise ValueError(f"speculative generate (n-gram history): longest prompt ({longest} tokens) + "
                       f"max_new_tokens ({max_new_tokens}) - 1 = {need} positions exceed the history size "
                       f"{max_len}; raise its max_len or shorten the prompt/budget")

  def storage_of(self, state: NgramState) -> NgramState:
    return state  # `init` overwrites all of it

  def init(self, storage: NgramState, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
           target_cache: KVCache) -> NgramState:
    batch, width = prompts_BxP.shape
    columns_BxP = jnp.broadcast_to(jnp.arange(width)[None, :], (batch, width))
    # Padding goes to an out-of-range column and is dropped: the history stays zero past each length.
    columns_BxP = jnp.where(columns_BxP < prompt_lengths_B[:, None], columns_BxP, storage.history.shape[1])
    rows_BxP = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, width))
    history = jnp.zeros_like(storage.history).at[rows_BxP, columns_BxP].set(prompts_BxP.astype(jnp.int32),
                                                                            mode="drop")
    return NgramState(history=history, lengths=prompt_lengths_B.astype(jnp.int32),
                      pending=jnp.zeros_like(storage.pending))

  def propose(self, state: NgramState, target_cache: KVCache, pending_B: jax.Array,
              sampling: SamplingParams, key: jax.Array, k: int) -> tuple[Proposal, NgramState, KVCache]:
    """Point masses on the (up to K) tokens that followed the match; `sampling` and `key` are unused
    (a lookup is deterministic, and the rule is exact for point masses at any temperature)."""
    context_BxS = _context(state, pending_B)
    width = context_BxS.shape[1]
    context_lengths_B = state.lengths + 1
    branches = 1 if self.tree is None else len(self.tree.children(0))
    found_BxR, end_BxR = ranked_matches(context_BxS, context_lengths_B, self.ngram_min, self.ngram_max, branches)
    positions_BxRxK = end_BxR[:, :, None] + 1 + jnp.arange(k)[None, None, :]
    tokens_BxRxK = jnp.take_along_axis(context_BxS[:, None, :], jnp.clip(positions_BxRxK, 0, width - 1), axis=2)
    lengths_BxR = jnp.where(found_BxR, jnp.minimum(k, context_lengths_B[:, None] - 1 - end_BxR), 0)
    lengths_B = jnp.max(lengths_BxR, axis=1).astype(jnp.int32)
    pending_state = state.replace(pending=pending_B.astype(jnp.int32))
    if self.tree is None:  # probs None: point masses
      return Proposal(tokens=tokens_BxRxK[:, 0], lengths=lengths_B), pending_state, target_cache
    # Spines: branch r's depth-d node is node (d - 1) b + r + 1. Slots past a branch's match hold the id
    # V, which no target distribution gives probability (never accepted, never equal to an argmax).
    unproposed_BxRxK = jnp.arange(k)[None, None, :] >= lengths_BxR[:, :, None]
    tokens_BxRxK = jnp.where(unproposed_BxRxK, self.vocab_size, tokens_BxRxK)
    tokens_BxN = jnp.swapaxes(tokens_BxRxK, 1, 2).reshape(len(pending_B), k * branches)
    return Proposal(tokens=tokens_BxN, lengths=lengths_B, tree=self.tree), pending_state, target_cache

  def commit(self, state: NgramState, proposal: Proposal, num_committed_B: jax.Array,
             target_hidden_BxK1xD: jax.Array) -> NgramState:
    batch, max_len = state.history.shape
    block_BxK1 = jnp.concatenate([state.pending[:, None], proposal.tokens], axis=1).astype(jnp.int32)
    slot_1xK1 = jnp.arange(block_BxK1.shape[1])[None, :]
    # Uncommitted slots go to an out-of-range column and are dropped (never clamped onto the history).
    columns_BxK1 = jnp.where(slot_1xK1 < num_committed_B[:, None], state.lengths[:, None] + slot_1xK1,
                             max_len)
    rows_BxK1 = jnp.broadcast_to(jnp.arange(batch)[:, None], block_BxK1.shape)
    return state.replace(history=state.history.at[rows_BxK1, columns_BxK1].set(block_BxK1, mode="drop"),
                         lengths=state.lengths + num_committed_B.astype(jnp.int32))
