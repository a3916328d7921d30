"""How a draft with another tokenizer reads the target's tokens, on device: each target id is spelled as
up to M draft ids (the feed table of `specjax.models.vocab_map`), so the target's committed tokens reach
the draft's cache with per-row counts, inside the compiled loop.

What the draft sees is the same text, tokenized per target token: a non-canonical tokenization (its own
tokenizer would often merge across the target's token boundaries). Its proposals can only be tokens of the
intersection, whose spelling is one draft id. A target token needing more than M draft ids (M =
`MAX_SPELLING`; rare: e.g. Qwen2.5's Thai tokens written as single bytes in SmolLM2's vocabulary) is cut
to its first M: the draft reads a slightly wrong history, which changes its guesses, never the exactness
of the output. M bounds the draft cache (M positions per target position) and the widest catch-up pass.

The model drafter with such a draft (`ModelDrafter.spelling` set, `head` an `intersection_head`) drafts
through the token-level intersection: it proposes target ids (its distribution restricted to the intersection,
renormalised) and reads every committed target token as the draft ids that spell it (`Spelling`: up to
M per token, per-row counts). The catch-up pass then feeds [d_K?, the pending token's ids] (1 to M + 1
ids, in the narrowest of the passes 1, 2 and M + 1 that holds every row's), a static tree's first pass
starts after all but the last of them, and the cache holds M positions per target position (`storage`).
Exactness is the usual rule's: tokens outside the intersection have draft probability 0 and come from the
residual with the target's probability.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import draft_vocab
from specjax.models import registry, vocab_map
from specjax.speculative.drafters.draft_head import DraftHead, intersection_head

if TYPE_CHECKING:
  from specjax.models.load import LoadedModel

MAX_SPELLING = 4  # the most draft ids one target token is fed as (M)


@flax.struct.dataclass
class Spelling:
  """Every target id as draft ids: `ids_VxM[t, :counts_V[t]]`."""

  ids_VxM: jax.Array  # [V, M] int32 draft ids, left-aligned (padding: 0)
  counts_V: jax.Array  # [V] int32 in [1, M]

  @property
  def max_ids(self) -> int:
    """M, static."""
    return self.ids_VxM.shape[1]

  def spell(self, tokens_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The draft ids [B, M] and their counts [B] of one target token per row."""
    return jnp.take(self.ids_VxM, tokens_B, axis=0), jnp.take(self.counts_V, tokens_B, axis=0)

  def spell_rows(self, tokens_BxP: jax.Array, lengths_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Right-padded rows of target tokens as right-padded rows of draft ids [B, P * M] and their lengths
    [B]: each token's ids follow the previous token's."""
    B, P = tokens_BxP.shape
    M = self.max_ids
    ids_BxPxM, counts_BxP = jnp.take(self.ids_VxM, tokens_BxP, axis=0), jnp.take(self.counts_V, tokens_BxP, axis=0)
    counts_BxP = jnp.where(jnp.arange(P)[None, :] < lengths_B[:, None], counts_BxP, 0)
    ends_BxP = jnp.cumsum(counts_BxP, axis=1)
    slot_BxPxM = (ends_BxP - counts_BxP)[:, :, None] + jnp.arange(M)[None, None, :]
    slot_BxPxM = jnp.where(jnp.arange(M)[None, None, :] < counts_BxP[:, :, None], slot_BxPxM, P * M)  # dropped
    rows_Bx1 = jnp.arange(B)[:, None]
    spelled_BxPM = jnp.zeros(
        (B, P * M), jnp.int32).at[rows_Bx1, slot_BxPxM.reshape(B, -1)].set(ids_BxPxM.reshape(B, -1), mode="drop")
    return spelled_BxPM, ends_BxP[:, -1]


def tokenizer_mismatch(target: LoadedModel, draft: LoadedModel) -> str | None:
  """Why the draft's ids do not mean the target's, None when they do. The acceptance ratio compares
  probabilities of the same ids: the tokenizers must agree on every id both heads score. The heads may
  differ in size (padding rows, e.g. Qwen2.5-0.5B's 151,936 against Qwen2.5-7B's 152,064): the
  acceptance rule gives the smaller one probability 0 beyond it."""
  shared = min(draft.config.vocab_size, target.config.vocab_size)
  if draft.tokenizer.fingerprint(below=shared) != target.tokenizer.fingerprint(below=shared):
    return (f"draft {draft.name} and target {target.name} have different tokenizers: some id below {shared} "
            f"(the range both heads score) maps to different tokens")
  return None


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
  """Raises ValueError unless the draft's ids mean the target's (`tokenizer_mismatch`)."""
  mismatch = tokenizer_mismatch(target, draft)
  if mismatch:
    raise ValueError(mismatch)


def spelling(vocab: vocab_map.VocabMap, limit: int = MAX_SPELLING) -> tuple[Spelling, int]:
  """The device table of a host `VocabMap`, each spelling cut to `limit` ids, and how many target ids
  were cut."""
  counts_V = np.minimum(vocab.feed_counts_V, limit)
  return (Spelling(ids_VxM=jnp.asarray(vocab.feed_VxM[:, :limit], jnp.int32),
                   counts_V=jnp.asarray(counts_V, jnp.int32)), int((vocab.feed_counts_V > limit).sum()))


def intersection_drafting(target: LoadedModel, draft: LoadedModel, size: int, corpus_source: str,
                          log: Callable[[str], None] = print) -> tuple[DraftHead, Spelling, dict]:
  """For a draft whose tokenizer differs from the target's: its head restricted to the token-level
  intersection (and to the `size` ids of it most frequent in `corpus_source` when size > 0), the spelling
  of the target's ids, and facts for the results (intersection size, its coverage of the corpus's target
  tokens, M, spellings cut). Host work, seconds for 150k-token vocabularies."""
  target_size = target.config.vocab_size
  vocab = vocab_map.between((target.tokenizer, target.config), (draft.tokenizer, draft.config))
  if not vocab.size:
    raise ValueError(f"draft {draft.name} and target {target.name} share no token: nothing to draft")
  counts_V = draft_vocab.corpus_token_counts(target.tokenizer, corpus_source, target_size, registry.cache_dir())
  coverage = vocab.coverage(counts_V)
  draft_ids_I, target_ids_I = vocab.draft_ids_I, vocab.target_ids_I
  if size:
    shared_V = np.full(target_size, -1, np.int64)  # only the intersection's ids can be chosen
    shared_V[target_ids_I] = counts_V[target_ids_I]
    stops = [t for t in target.tokenizer.eos_ids if t < target_size and vocab.target_to_draft_V[t] >= 0]
    target_ids_I = draft_vocab.most_frequent(shared_V, min(size, vocab.size), always=stops)
    draft_ids_I = vocab.target_to_draft_V[target_ids_I]
  head = intersection_head(draft.config, draft.params, draft_ids_I, target_ids_I, target_size)
  table, cut = spelling(vocab)
  facts = {
      "vocab_intersection": int(vocab.size), "vocab_intersection_coverage": coverage,
      "draft_head_tokens": int(len(target_ids_I)), "draft_head_coverage": vocab_map.coverage(counts_V, target_ids_I),
      "spelled_ids": table.max_ids, "spellings_cut": cut
  }
  log(f"draft {draft.name} has another tokenizer than target {target.name}: drafting through the token-level "
      f"intersection of {vocab.size} ids ({coverage:.1%} of the target's tokens of {corpus_source!r}); the draft "
      f"proposes {len(target_ids_I)} of them and reads each target token as up to {table.max_ids} of its ids "
      f"({cut} longer spellings cut)")
  return head, table, facts
