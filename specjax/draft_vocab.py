"""Choosing a restricted draft head's vocabulary on the host: the Vd tokens most frequent in a corpus
(FR-Spec), counted once per tokenizer and corpus and cached on disk. `speculative.draft_head` builds
the head from the chosen ids."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Iterable, Sequence

import numpy as np

from specjax import corpus
from specjax.models.tokenizer import Tokenizer


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
  """The `size` ids [Vd] (ascending) with the highest counts, ties broken by the smaller id, always
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
  counts_V = token_counts(lambda t: tokenizer.encode(t, add_special_tokens=False), (d.text for d in docs), vocab_size)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  temporary = f"{path}.{os.getpid()}.tmp.npy"
  np.save(temporary, counts_V)
  os.replace(temporary, path)
  return counts_V
