"""Distillation data: text sources, a deterministic train / held-out split, packing, a resumable batch
stream, and the DistillSpec generation modes (fixed text, target- or draft-generated continuations).

Pipeline: `specjax.corpus.read_documents` (a directory or glob of files, "stdlib" for the standard library's
own sources, a text file split at blank lines, or a JSONL file) -> `split_documents` (shuffled by a
seed, split *by document* so no held-out file leaks into training) -> `pack` (tokenized, documents
joined by a separator token and cut into fixed-length rows with a validity mask) -> `BatchStream`.

A `BatchStream` is random access: batch i is a pure function of (data, seed, i), reshuffled every
epoch. Its whole state is the number of batches served, so a checkpoint restores it exactly.
`DistillBatches` picks each batch's generation mode from (seed, i) as well, and the caller passes a key
derived from i, which keeps on-policy runs resumable bit for bit too.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from specjax import autoregressive, mesh as meshes, partitioning
from specjax.corpus import Document
from specjax.generation import Request, pad_prompts
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import Params
from specjax.sampling import SamplingParams

MODES = ("fixed", "target", "student")  # text itself; target-generated; draft-generated (on-policy)


def split_documents(docs: Sequence[Document], heldout_fraction: float,
                    seed: int) -> tuple[list[Document], list[Document]]:
  """(train, held-out): a seeded shuffle, then the first `heldout_fraction` (at least one) held out."""
  if not 0.0 < heldout_fraction < 1.0:
    raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
  if len(docs) < 2:
    raise ValueError(f"need at least 2 documents to split into train and held-out, got {len(docs)}")
  order = np.random.default_rng(seed).permutation(len(docs))
  num_heldout = min(len(docs) - 1, max(1, round(heldout_fraction * len(docs))))
  shuffled = [docs[i] for i in order]
  return shuffled[num_heldout:], shuffled[:num_heldout]


@dataclasses.dataclass(frozen=True)
class Packed:
  """Fixed-length token rows; `mask` marks real tokens (False only in the last row's padding)."""

  tokens: np.ndarray  # [Z, T] int32
  mask: np.ndarray  # [Z, T] bool

  def fingerprint(self) -> str:
    """sha256 of the rows: a checkpoint refuses to resume on different data."""
    digest = hashlib.sha256(np.ascontiguousarray(self.tokens).tobytes())
    digest.update(np.ascontiguousarray(self.mask).tobytes())
    return digest.hexdigest()


def pack(docs: Sequence[Document], encode: Callable[[str], list[int]], seq_len: int, separator_id: int,
         max_tokens: int = 0) -> Packed:
  """Tokenizes the documents, joins them with `separator_id` and cuts the stream into `seq_len` rows.

  Rows may span document boundaries (the model has no segment masking: a row simply reads on into
  the next document, as in most LM pre-training). `max_tokens` > 0 caps the stream's length.
  """
  if seq_len < 2:
    raise ValueError(f"seq_len must be >= 2, got {seq_len}")
  pieces, total = [], 0
  for doc in docs:
    ids = list(encode(doc.text)) + [separator_id]
    pieces.append(np.asarray(ids, np.int32))
    total += len(ids)
    if max_tokens and total >= max_tokens:
      break
  stream = np.concatenate(pieces)[:max_tokens or None]
  num_rows = -(-len(stream) // seq_len)
  tokens = np.full(num_rows * seq_len, separator_id, np.int32)
  tokens[:len(stream)] = stream
  mask = np.arange(num_rows * seq_len) < len(stream)
  return Packed(tokens.reshape(num_rows, seq_len), mask.reshape(num_rows, seq_len))


class BatchStream:
  """Batches of `batch_size` rows, reshuffled each epoch; batch i depends only on (rows, seed, i)."""
  def __init__(self, data: Packed, batch_size: int, seed: int):
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    self.data, self.batch_size, self.seed = data, batch_size, seed
    self.position = 0  # batches served so far: the stream's whole state

  def batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch `index`: tokens [B, T] int32 and mask [B, T] bool."""
    num_rows = len(self.data.tokens)
    sample = index * self.batch_size + np.arange(self.batch_size)
    epochs, within = np.divmod(sample, num_rows)
    rows = np.array([self._order(int(e))[w] for e, w in zip(epochs, within)])
    return self.data.tokens[rows], self.data.mask[rows]

  def _order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.data.tokens))

  def state(self) -> dict:
    return {"position": self.position, "fingerprint": self.data.fingerprint()}

  def restore(self, state: Mapping) -> None:
    if state["fingerprint"] != self.data.fingerprint():
      raise ValueError("the checkpoint was made on different training data (source, tokenizer, "
                       "seq_len or split changed); use a fresh workdir")
    self.position = int(state["position"])


class Continuation(NamedTuple):
  """How a generation mode continues a row: after its first `prompt_len` tokens, drawn with `sampling`,
  stopping at `eos_ids`."""

  prompt_len: int
  eos_ids: tuple[int, ...]
  sampling: SamplingParams


def continue_rows(config: ModelConfig, params: Params, tokens_BxT: np.ndarray, mask_BxT: np.ndarray, how: Continuation,
                  key: jax.Array, part: partitioning.Partitioning | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Replaces everything after each row's first `how.prompt_len` tokens by the model's own continuation.

  Uses the project's autoregressive loop (one compiled program per model and shape). The returned mask
  covers the positions whose next-token distribution produced a generated token: the divergence is
  taken on the sequences the model (target, or the draft on-policy) actually emits, as in DistillSpec.
  With `part` (the params' partitioning) the loop runs on its mesh: cache and rows split as in decoding.
  """
  B, T = tokens_BxT.shape
  prompt_len = how.prompt_len
  if not 1 <= prompt_len < T:
    raise ValueError(f"prompt_len must be in [1, seq_len) = [1, {T}), got {prompt_len}")
  lengths_B = np.minimum(mask_BxT.sum(1), prompt_len)  # >= 1: a packed row holds at least one token
  prompts_BxP, _ = pad_prompts([row[:n] for row, n in zip(tokens_BxT, lengths_B)])
  generate = lambda *rows: autoregressive.generate(
      config, params, Request(*rows, T - prompt_len, list(how.eos_ids), how.sampling, key),
      init_cache(config, B, T, partitioning.cache_sharding(config, part)), out_width=T - prompt_len)
  if part is None:
    out = generate(prompts_BxP, lengths_B)
  else:
    rows = partitioning.rows_sharding(part)
    with jax.set_mesh(part.mesh):
      out = generate(*(jax.make_array_from_callback(x.shape, rows, lambda index, x=x: x[index])
                       for x in (np.asarray(prompts_BxP), np.asarray(lengths_B, np.int32))))
  generated_BxO, counts_B = meshes.to_host((out.tokens, out.counts))
  new_BxT = np.zeros_like(tokens_BxT)
  new_mask_BxT = np.zeros((B, T), bool)
  for b, (n, c) in enumerate(zip(lengths_B, counts_B)):
    new_BxT[b, :n] = tokens_BxT[b, :n]
    new_BxT[b, n:n + c] = generated_BxO[b, :c]
    new_mask_BxT[b, n - 1:n + c - 1] = True
  return new_BxT, new_mask_BxT


class DistillBatches:
  """Training batches mixed from the generation modes, each chosen by weight from (seed, index).

  `weights` maps modes of `MODES` to non-negative weights. "target" continuations use the teacher's
  fixed params; "student" (on-policy) ones the params passed to `next`, i.e. the current draft. Both
  continue as `how` says and draw from the key passed to `next`. `parts`: where the target's and the
  student's params lie (their mesh partitionings; None for one device).
  """
  def __init__(self, stream: BatchStream, weights: Mapping[str, float], seed: int, how: Continuation,
               target_config: ModelConfig, target_params: Params, student_config: ModelConfig,
               parts: tuple[partitioning.Partitioning | None, partitioning.Partitioning | None] = (None, None)):
    unknown = sorted(set(weights) - set(MODES))
    if unknown:
      raise ValueError(f"unknown generation mode(s) {unknown}; expected some of {MODES}")
    total = sum(weights.values())
    if min(weights.values(), default=-1.0) < 0 or total <= 0:
      raise ValueError(f"generation mode weights must be >= 0 with a positive sum, got {dict(weights)}")
    self.stream, self.how, self.seed = stream, how, seed
    self.modes = [m for m in MODES if weights.get(m, 0.0) > 0]
    self.probs = np.array([weights[m] for m in self.modes]) / total
    self.target_config, self.target_params, self.student_config = target_config, target_params, student_config
    self.target_part, self.student_part = parts

  def mode(self, index: int) -> str:
    return self.modes[np.random.default_rng([self.seed, index]).choice(len(self.modes), p=self.probs)]

  def next(self, student_params: Params, key: jax.Array) -> tuple[np.ndarray, np.ndarray, str]:
    """The next batch (tokens [B, T] int32, loss mask [B, T] bool, mode) and advances the stream;
    `key` samples a generated continuation (pass a pure function of the position to stay resumable)."""
    index = self.stream.position
    tokens_BxT, mask_BxT = self.stream.batch(index)
    mode = self.mode(index)
    if mode != "fixed":
      config, params, part = ((self.target_config, self.target_params, self.target_part) if mode == "target" else
                              (self.student_config, student_params, self.student_part))
      tokens_BxT, mask_BxT = continue_rows(config, params, tokens_BxT, mask_BxT, self.how, key, part)
    self.stream.position += 1
    return tokens_BxT, mask_BxT, mode
