"""Prompt lookup decoding: an n-gram drafter that copies what followed an earlier occurrence of the
context's last tokens (Saxena 2023; HF `prompt_lookup_num_tokens`, vLLM's `ngram` method), on device,
inside the jitted loop, with no model and no table: the context is the row's own history. It is a
`HistoryDrafter` (the base keeps the history buffer and the point masses); its config group is
`config.ngram` (`min`, `max`).

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

from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections

from specjax.errors import ConfigError
from specjax.speculative.drafters.base import DrafterSettings
from specjax.speculative.drafters.history import HistoryDrafter, spines
from specjax.speculative.proposal import Proposal
from specjax.speculative.trees.tree import Tree, from_branching


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


def _settings_error(shortest, longest, tree: Tree | None) -> str | None:
  """What is wrong with the suffix sizes `shortest`..`longest` and the tree (None when nothing is):
  "min ...", "max ..." or "tree ...", for the caller to prefix with its field names."""
  if int(shortest) != shortest or shortest < 1:
    return f"min must be an integer >= 1, got {shortest}"
  if int(longest) != longest or longest < shortest:
    return f"max must be an integer >= min ({shortest}), got {longest}"
  if tree is not None and not (isinstance(tree, Tree) and is_spines(tree)):
    return (f"tree {tree}: the n-gram drafter drafts spines, (b, 1, ..., 1): its b best matches with distinct "
            f"next tokens, each continued the tree's depth")
  return None


def is_spines(tree: Tree) -> bool:
  """True for `(b, 1, ..., 1)`: b branches from the root, each a chain of the tree's depth."""
  b = len(tree.children(0))
  return tree == from_branching((b,) + (1,) * (tree.max_depth - 1))


class NgramDrafter(HistoryDrafter):
  """Prompt lookup: proposes what followed the earliest earlier occurrence of the longest matching
  suffix of 1 <= ngram_min <= n <= ngram_max tokens (see the module docstring)."""

  name: ClassVar[str] = "ngram"
  ngram_min: int = flax.struct.field(pytree_node=False, default=1)
  ngram_max: int = flax.struct.field(pytree_node=False, default=3)
  tree: Tree | None = flax.struct.field(pytree_node=False, default=None)  # spines (b, 1, ..., 1); None = a chain

  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    group = ml_collections.ConfigDict()
    group.min = 1  # shortest suffix of the history looked up (>= 1)
    group.max = 3  # longest suffix looked up (>= min); the longest match wins
    return group

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    error = _settings_error(settings.options.min, settings.options.max, settings.tree)
    if error:
      raise ConfigError(f"config.{error}" if error.startswith("tree") else f"config.ngram.{error}")

  @classmethod
  def build(cls, settings: DrafterSettings, target, draft, log=print) -> tuple[NgramDrafter, dict]:
    return cls(vocab_size=target.config.vocab_size, ngram_min=int(settings.options.min),
               ngram_max=int(settings.options.max), tree=settings.tree), {}

  def __post_init__(self):
    error = _settings_error(self.ngram_min, self.ngram_max, self.tree)
    if error:
      raise ValueError(error if error.startswith("tree") else f"ngram_{error}")

  def propose_from_history(self, history_BxS: jax.Array, lengths_B: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    tokens_BxRxK, lengths_BxR = self._continuations(history_BxS, lengths_B, k, branches=1)
    return tokens_BxRxK[:, 0], lengths_BxR[:, 0]

  def propose_from_context(self, context_BxS: jax.Array, context_lengths_B: jax.Array, k: int) -> Proposal:
    """A chain (`propose_from_history`), or spines (`history.spines`)."""
    if self.tree is None:
      return super().propose_from_context(context_BxS, context_lengths_B, k)
    tokens_BxRxK, lengths_BxR = self._continuations(context_BxS, context_lengths_B, k, len(self.tree.children(0)))
    return spines(tokens_BxRxK, lengths_BxR, self.vocab_size, self.tree)

  def _continuations(self, context_BxS: jax.Array, context_lengths_B: jax.Array, k: int,
                     branches: int) -> tuple[jax.Array, jax.Array]:
    """([B, R, K] the tokens after each of the R best matches, [B, R] how many of them are proposed)."""
    width = context_BxS.shape[1]
    found_BxR, end_BxR = ranked_matches(context_BxS, context_lengths_B, self.ngram_min, self.ngram_max, branches)
    positions_BxRxK = end_BxR[:, :, None] + 1 + jnp.arange(k)[None, None, :]
    tokens_BxRxK = jnp.take_along_axis(context_BxS[:, None, :], jnp.clip(positions_BxRxK, 0, width - 1), axis=2)
    lengths_BxR = jnp.where(found_BxR, jnp.minimum(k, context_lengths_B[:, None] - 1 - end_BxR), 0)
    return tokens_BxRxK, lengths_BxR
