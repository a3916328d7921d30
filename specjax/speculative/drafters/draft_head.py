"""A draft output head that scores only the Vd most frequent tokens (frequency-ranked drafting, as in
FR-Spec, Zhao et al. 2025).

With a large vocabulary the output head is a big share of a small draft's cost: Qwen2.5-0.5B spends
136M of its 494M weights scoring 151,936 tokens at every step. Restricting the draft's head to the Vd
tokens most frequent in a corpus makes every draft step cheaper; the draft then proposes only those
tokens and gives probability 0 to all others. Exactness is untouched: the acceptance rule holds for any
draft distribution, and after a rejection the residual max(0, q - p) equals q outside the subset, so
tokens the draft cannot propose are still emitted with the target's probability. The price is
acceptance: a round stops wherever the target wants a token outside the subset. Choosing the subset
(counting a corpus's tokens) is host-side work: `specjax.draft_vocab`.

A draft with another tokenizer scores through the same kind of head (`intersection_head`): its rows are
the draft ids of the token-level intersection (`specjax.models.vocab_map`) and its scores land on their
partners' target ids, so the draft's distribution is its own restricted to the intersection,
renormalised, over the target's vocabulary; `draft_inputs` turns the target ids it proposed back into
draft ids to feed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from specjax import draft_vocab
from specjax.errors import ConfigError
from specjax.models import matmul, quantized, registry, vocab_map
from specjax.models.attention_mask import soft_cap
from specjax.models.config import ModelConfig
from specjax.models.transformer import Params, hidden_to_logits, output_head

if TYPE_CHECKING:
  from specjax.models.load import LoadedModel


@flax.struct.dataclass
class DraftHead:
  """The rows of a draft's output head for a subset of the vocabulary."""

  tokens_Vd: jax.Array  # [Vd] int32 the model's ids this head scores, distinct (ascending unless `targets_Vd`)
  # [Vd, D] their rows of the output head (of the embedding when it is tied), float or quantized
  weight_VdxD: jax.Array | quantized.QuantizedWeight
  vocab_size: int = flax.struct.field(pytree_node=False)  # V, the vocabulary the scores are laid out in
  softcap: float = flax.struct.field(pytree_node=False, default=0.0)  # the model's final soft-cap (Gemma 2)
  matmul: str = flax.struct.field(pytree_node=False, default="xla")  # the model's `ModelConfig.matmul`
  # Another tokenizer's ids: where each score lands in V (distinct), and the model's id of each of those
  # ids (0 elsewhere). None: the scores land on `tokens_Vd` themselves.
  targets_Vd: jax.Array | None = None  # [Vd] int32
  inputs_V: jax.Array | None = None  # [V] int32

  def scores(self, hidden_xD: jax.Array) -> jax.Array:
    """Float32 (soft-capped) logits [..., Vd] of the subset's tokens, in the order of `tokens_Vd`."""
    scores_xVd = matmul.dense(hidden_xD.astype(self.weight_VdxD.dtype), self.weight_VdxD, self.matmul,
                              jnp.float32)  # accumulated in float32, never rounded
    return soft_cap(scores_xVd, self.softcap)

  def logits(self, hidden_xD: jax.Array) -> jax.Array:
    """Float32 logits [..., V]: the subset's `scores`, -inf (probability 0) everywhere else."""
    logits_xV = jnp.full(hidden_xD.shape[:-1] + (self.vocab_size,), -jnp.inf, jnp.float32)
    targets_Vd = self.tokens_Vd if self.targets_Vd is None else self.targets_Vd
    return logits_xV.at[..., targets_Vd].set(self.scores(hidden_xD))


def draft_logits(config: ModelConfig, params: Params, head: DraftHead | None, hidden_xD: jax.Array) -> jax.Array:
  """Float32 logits [..., V] of a draft: through its full output head, or through `head` when given."""
  return hidden_to_logits(config, params, hidden_xD) if head is None else head.logits(hidden_xD)


def draft_inputs(config: ModelConfig, head: DraftHead | None, tokens_xT: jax.Array) -> jax.Array:
  """The ids to feed the draft for tokens it proposed (or the target committed, when they share a
  tokenizer): its own ids through an `intersection_head`, else the tokens, with ids beyond the draft's
  vocabulary replaced by its last id (`jnp.take` would embed them as NaN, poisoning the draft's cache;
  any finite guess keeps the rule exact)."""
  if head is not None and head.inputs_V is not None:
    return jnp.take(head.inputs_V, tokens_xT, axis=0)
  return jnp.minimum(tokens_xT, config.vocab_size - 1)


def intersection_head(config: ModelConfig, params: Params, draft_ids: Sequence[int], target_ids: Sequence[int],
                      target_vocab_size: int) -> DraftHead:
  """The head of a draft with another tokenizer: its rows `draft_ids`, their scores laid out at the paired
  `target_ids` of a `target_vocab_size` vocabulary (a one-to-one pairing: a duplicate would drop or double
  count probability mass)."""
  draft_Vd, target_Vd = np.asarray(draft_ids, np.int64), np.asarray(target_ids, np.int64)
  if draft_Vd.shape != target_Vd.shape or len(np.unique(draft_Vd)) != draft_Vd.size or (len(np.unique(target_Vd))
                                                                                        != target_Vd.size):
    raise ValueError("the intersection must pair distinct draft ids with as many distinct target ids")
  if target_Vd.size and (target_Vd.min() < 0 or target_Vd.max() >= target_vocab_size):
    raise ValueError(f"target ids must be in [0, {target_vocab_size}), got {target_Vd.min()}..{target_Vd.max()}")
  head = restrict_head(config, params, draft_Vd)  # rows ascending by draft id
  order = np.argsort(draft_Vd)
  inputs_V = np.zeros(target_vocab_size, np.int32)
  inputs_V[target_Vd] = draft_Vd
  return head.replace(vocab_size=target_vocab_size, targets_Vd=jnp.asarray(target_Vd[order], jnp.int32),
                      inputs_V=jnp.asarray(inputs_V))


def restrict_head(config: ModelConfig, params: Params, tokens: Sequence[int]) -> DraftHead:
  """The head of the model `params` restricted to `tokens` (gathered once, outside any jit)."""
  tokens_Vd = np.unique(np.asarray(tokens, np.int64))
  if tokens_Vd.size == 0:
    raise ValueError("a restricted draft head needs at least one token")
  if tokens_Vd[0] < 0 or tokens_Vd[-1] >= config.vocab_size:
    raise ValueError(f"head token ids must be in [0, {config.vocab_size}), got {tokens_Vd[0]}..{tokens_Vd[-1]}")
  full_VxD = output_head(config, params)
  tokens_Vd = jnp.asarray(tokens_Vd, jnp.int32)
  return DraftHead(tokens_Vd=tokens_Vd, weight_VdxD=quantized.take_rows(full_VxD, tokens_Vd),
                   vocab_size=config.vocab_size, softcap=config.final_softcap, matmul=config.matmul)


def add_vocab_options(group: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The restricted-head fields of a model-backed drafter's config group (`config.model.vocab`, ...)."""
  group.vocab = 0  # > 0: the draft's head scores only this many most frequent tokens (0 = all of them)
  group.vocab_corpus = "stdlib"  # the corpus ranking them: "stdlib", a directory, glob, text or JSONL file
  return group


def check_vocab_options(options: ml_collections.ConfigDict, group: str) -> None:
  if int(options.vocab) != options.vocab or options.vocab < 0:
    raise ConfigError(f"config.{group}.vocab must be an integer >= 0 (0 = the full vocabulary), got "
                      f"{options.vocab}")


def restricted_draft_head(size: int, corpus_source: str, target: LoadedModel, draft: LoadedModel,
                          log: Callable[[str], None] = print) -> tuple[DraftHead | None, float | None]:
  """The draft's head restricted to the `size` tokens most frequent in `corpus_source` (stop tokens
  included), and the share of the corpus's tokens it covers; (None, None) for size 0, the full head."""
  if not size:
    return None, None
  log(f"ranking tokens of {corpus_source!r} for a {size}-token draft head ...")
  counts_V = draft_vocab.corpus_token_counts(target.tokenizer, corpus_source, draft.config.vocab_size,
                                             registry.cache_dir())
  tokens_Vd = draft_vocab.most_frequent(counts_V, size, always=target.tokenizer.eos_ids)
  coverage = vocab_map.coverage(counts_V, tokens_Vd)
  log(f"the draft head scores {len(tokens_Vd)} of {draft.config.vocab_size} tokens, {coverage:.2%} of "
      f"the corpus's tokens")
  return restrict_head(draft.config, draft.params, tokens_Vd), coverage
