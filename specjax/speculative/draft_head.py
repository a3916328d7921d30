"""A draft output head that scores only the N most frequent tokens (frequency-ranked drafting, as in
FR-Spec, Zhao et al. 2025).

With a large vocabulary the output head is a big share of a small draft's cost: Qwen2.5-0.5B spends
136M of its 494M weights scoring 151,936 tokens at every step. Restricting the draft's head to the N
tokens most frequent in a corpus makes every draft step cheaper; the draft then proposes only those
tokens and gives probability 0 to all others. Exactness is untouched: the acceptance rule holds for any
draft distribution, and after a rejection the residual max(0, q - p) equals q outside the subset, so
tokens the draft cannot propose are still emitted with the target's probability. The price is
acceptance: a round stops wherever the target wants a token outside the subset.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import corpus
from specjax.models.config import ModelConfig
from specjax.models.tokenizer import Tokenizer
from specjax.models.transformer import Params, hidden_to_logits


@flax.struct.dataclass
class DraftHead:
  """The rows of a draft's output head for a subset of the vocabulary."""

  tokens_N: jax.Array  # [N] int32 vocabulary ids this head scores, ascending and distinct
  weight_NxD: jax.Array  # [N, D] their rows of the output head (of the embedding when it is tied)
  vocab_size: int = flax.struct.field(pytree_node=False)  # V, the full vocabulary

  def logits(self, hidden_xD: jax.Array) -> jax.Array:
    """Float32 logits [..., V]: the subset's scores, -inf (probability 0) everywhere else."""
    scores_xN = jnp.einsum("...d,nd->...n", hidden_xD, self.weight_NxD).astype(jnp.float32)
    logits_xV = jnp.full(hidden_xD.shape[:-1] + (self.vocab_size,), -jnp.inf, jnp.float32)
    return logits_xV.at[..., self.tokens_N].set(scores_xN)


def draft_logits(config: ModelConfig, params: Params, head: DraftHead | None, hidden_xD: jax.Array) -> jax.Array:
  """Float32 logits [..., V] of a draft: through its full output head, or through `head` when given."""
  return hidden_to_logits(config, params, hidden_xD) if head is None else head.logits(hidden_xD)


def restrict_head(config: ModelConfig, params: Params, tokens: Sequence[int]) -> DraftHead:
  """The head of the model `params` restricted to `tokens` (gathered once, outside any jit)."""
  tokens_N = np.unique(np.asarray(tokens, np.int64))
  if tokens_N.size == 0:
    raise ValueError("a restricted draft head needs at least one token")
  if tokens_N[0] < 0 or tokens_N[-1] >= config.vocab_size:
    raise ValueError(f"head token ids must be in [0, {config.vocab_size}), got {tokens_N[0]}..{tokens_N[-1]}")
  full_VxD = params["embed"]["embedding"] if config.tie_embeddings else params["lm_head"]["weight"]
  tokens_N = jnp.asarray(tokens_N, jnp.int32)
  return DraftHead(tokens_N=tokens_N, weight_NxD=jnp.take(full_VxD, tokens_N, axis=0),
                   vocab_size=config.vocab_size)


def token_counts(encode: Callable[[str], list[int]], texts: Iterable[str], vocab_size: int) -> np.ndarray:
  """Occurrences [V] (int64) of every token id in the encoded `texts`."""
  counts_V = np.zeros(vocab_size, np.int64)
  for text in texts:
    ids = np.asarray(encode(text), np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
      raise ValueError(f"the tokenizer produced ids outside [0, {vocab_size})")
    counts_V += np.bincount(ids, minlength=vocab_size)
  return counts_V


def most_frequent(counts_V: np.ndarray, size: int, always: Sequence[int] = ()) -> np.ndarray:
  """The `size` ids [N] (ascending) with the highest counts, ties broken by the smaller id, always
  including `always` (stop tokens: a draft that cannot propose EOS cannot end a row's block)."""
  vocab_size = counts_V.shape[0]
  if not 1 <= size <= vocab_size:
    raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
  required = sorted(set(int(t) for t in always))
  if len(required) > size:
    raise ValueError(f"draft vocabulary size {size} cannot hold the {len(required)} required tokens")
  ranked_V = np.lexsort((np.arange(vocab_size), -counts_V))  # by count descending, then id
  rest_R = ranked_V[~np.isin(ranked_V, required)][:size - len(required)]
  return np.sort(np.concatenate([np.asarray(required, np.int64), rest_R]).astype(np.int32))


def corpus_token_counts(tokenizer: Tokenizer, source: str, vocab_size: int, cache_dir: str) -> np.ndarray:
  """`token_counts` [V] of a `specjax.corpus` source (e.g. "stdlib") under `tokenizer`, cached on disk
  per (tokenizer fingerprint, source, V): counting the standard library takes a minute on 2 cores."""
  key = hashlib.sha256(json.dumps([tokenizer.fingerprint(), source, vocab_size]).encode()).hexdigest()[:16]
  path = os.path.join(cache_dir, "token_counts", f"{key}.npy")
  if os.path.exists(path):
    return np.load(path)
  docs = corpus.read_documents(source)
  counts_V = token_counts(lambda t: tokenizer.encode(t, add_special_tokens=False), (d.text for d in docs),
                          vocab_size)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  temporary = f"{path}.{os.getpid()}.tmp.npy"
  np.save(temporary, counts_V)
  os.replace(temporary, path)
  return counts_V
