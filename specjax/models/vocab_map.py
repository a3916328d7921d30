"""Mapping between a target's and a draft's vocabularies when their tokenizers differ (token-level
intersection, "TLI", Timor et al. 2025), built once on the host.

Both vocabularies are first read as byte strings (`token_bytes`): the bytes each id stands for in decoded
text, from byte-level BPE (GPT-2's byte-to-unicode alphabet) or SentencePiece pieces ("▁" for a space,
`<0xNN>` byte-fallback tokens). `build` then pairs the ids whose byte strings are equal, one to one (the
drafter scatters the draft's probabilities onto the target ids of the pairs), and writes for every target
id the draft ids that spell its bytes (the draft reads the target's committed tokens through them).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.tokenizer import Tokenizer

NORMAL, SPECIAL, ADDED, UNDEFINED = 0, 1, 2, 3  # TokenBytes.kind_V
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def coverage(counts_V: np.ndarray, ids: Sequence[int] | np.ndarray) -> float:
  """The share of a corpus's tokens (occurrences per id, [V]) whose id is among `ids`; 0.0 when empty."""
  return float(counts_V[np.asarray(ids, np.int64)].sum() / max(counts_V.sum(), 1))


@dataclasses.dataclass(frozen=True, eq=False)
class TokenBytes:
  """The bytes of every id of a vocabulary of V ids (a model head may be larger than its tokenizer)."""
  strings: list[bytes]  # [V]: the bytes id i stands for in decoded text; b"" when UNDEFINED
  kind_V: np.ndarray  # int8 [V]: NORMAL, SPECIAL (control), ADDED (non-special added token) or UNDEFINED
  byte_fallback_V: np.ndarray  # bool [V]: a SentencePiece <0xNN> token (NORMAL, one byte)


@dataclasses.dataclass(frozen=True, eq=False)
class VocabMap:
  """Target <-> draft ids: the one-to-one intersection of equal byte strings, and per target id the draft
  ids whose bytes concatenate to its bytes."""
  draft_ids_I: np.ndarray  # int32 [I]: draft ids of the intersection, ascending
  target_ids_I: np.ndarray  # int32 [I]: the target id with the same bytes as each draft id
  target_to_draft_V: np.ndarray  # int32 [V_target]: each target id's partner in the intersection, or -1
  feed_VxM: np.ndarray  # int32 [V_target, M]: draft ids spelling each target id, left-aligned, 0-padded
  feed_counts_V: np.ndarray  # int32 [V_target]: how many ids of each feed_VxM row are used (1..M)
  spelled_V: np.ndarray  # bool [V_target]: the feed row's bytes are exactly the target id's bytes

  @property
  def size(self) -> int:
    """I: the number of paired ids."""
    return int(self.draft_ids_I.shape[0])

  @property
  def max_feed(self) -> int:
    """M: the most draft ids one target id needs (static on device)."""
    return int(self.feed_VxM.shape[1])

  def coverage(self, target_counts_V: np.ndarray) -> float:
    """The share of target tokens (occurrences per target id over some corpus) that the draft can
    propose: those whose id lies in the intersection; 0.0 for an empty corpus."""
    return coverage(target_counts_V, self.target_ids_I)


def _gpt2_byte_of_char() -> dict[str, int]:
  """GPT-2's `bytes_to_unicode` inverted: each byte is written as one printable character."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  others = [b for b in range(256) if b not in printable]
  return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def _components(node: Any) -> list[dict]:
  """Every typed component (decoder step, pre-tokenizer, ...) inside a node of tokenizer.json."""
  if isinstance(node, list):
    return [c for item in node for c in _components(item)]
  if isinstance(node, dict):
    return [node] * ("type" in node) + [c for value in node.values() for c in _components(value)]
  return []


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> TokenBytes:
  """The bytes of ids [0, vocab_size): added and special tokens are their content as UTF-8; ids the
  tokenizer lacks and its `unused_ids` are UNDEFINED. A model's unknown token is SPECIAL (it stands for
  no text). Raises ValueError for a tokenizer that is neither byte-level, SentencePiece-style nor made of
  plain pieces that decoding only joins (e.g. WordPiece): its pieces have no byte meaning we could trust."""
  backend = tokenizer.backend
  config = json.loads(backend.to_str())
  model = config["model"]
  decoder = _components(config["decoder"])
  types = {c["type"] for c in _components(config["pre_tokenizer"]) + decoder}
  byte_level = "ByteLevel" in types
  sentencepiece = "Metaspace" in types or any(
      c["type"] == "Replace" and c["pattern"].get("String") == "▁" and c["content"] == " " for c in decoder)
  affixes = model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")
  # Plain pieces: no pre-tokenizer and a decoder that only joins them, so decoded text is their concatenation.
  plain = not (byte_level or sentencepiece) and config["pre_tokenizer"] is None and types <= {"Fuse"}
  if model["type"] not in ("BPE", "Unigram") or (byte_level == sentencepiece and not plain) or affixes:
    raise ValueError(f"cannot read the bytes of a {model['type']} tokenizer with pre-tokenizer and decoder "
                     f"{sorted(types)}: only byte-level BPE, SentencePiece-style and plain-piece vocabularies map")
  byte_fallback = bool(model.get("byte_fallback")) or "ByteFallback" in types
  byte_of_char = _gpt2_byte_of_char()

  def piece_bytes(piece: str) -> tuple[bytes, bool]:
    if byte_level:  # as tokenizers' ByteLevel decoder: a piece outside the alphabet decodes as UTF-8
      try:
        return bytes(map(byte_of_char.__getitem__, piece)), False
      except KeyError:
        return piece.encode(), False
    match = _BYTE_FALLBACK.fullmatch(piece) if byte_fallback else None
    if match:
      return bytes([int(match[1], 16)]), True
    return (piece.replace("▁", " ") if sentencepiece else piece).encode(), False

  strings = [b""] * vocab_size
  kind_V = np.full(vocab_size, UNDEFINED, np.int8)
  byte_fallback_V = np.zeros(vocab_size, bool)
  for piece, i in backend.get_vocab(with_added_tokens=False).items():
    if i < vocab_size:
      strings[i], byte_fallback_V[i] = piece_bytes(piece)
      kind_V[i] = NORMAL if strings[i] else UNDEFINED
  unknown = model.get("unk_token") if model["type"] == "BPE" else model.get("unk_id")
  unknown_id = backend.token_to_id(unknown) if isinstance(unknown, str) else unknown
  if unknown_id is not None and unknown_id < vocab_size:
    kind_V[unknown_id] = SPECIAL
  for i, token in backend.get_added_tokens_decoder().items():
    if i < vocab_size:
      strings[i], byte_fallback_V[i] = token.content.encode(), False
      kind_V[i] = SPECIAL if token.special else ADDED
  for i in tokenizer.unused_ids:
    if i < vocab_size:
      strings[i], kind_V[i], byte_fallback_V[i] = b"", UNDEFINED, False
  return TokenBytes(strings, kind_V, byte_fallback_V)


def _by_preference(vocab: TokenBytes) -> np.ndarray:
  """Ids with bytes, in the order that picks one representative per byte string: normal tokens, then
  added ones, then byte-fallback ones, each by id (specials, keyed apart, by id)."""
  rank_V = np.select([vocab.kind_V == ADDED, vocab.byte_fallback_V], [1, 2], 0)
  order = np.lexsort((np.arange(rank_V.shape[0]), rank_V))
  return order[vocab.kind_V[order] != UNDEFINED]


def _representatives(vocab: TokenBytes, order: np.ndarray) -> dict[tuple[bool, bytes], int]:
  """(is special, bytes) -> the preferred id holding them."""
  chosen = {}
  for i in order.tolist():
    chosen.setdefault((vocab.kind_V[i] == SPECIAL, vocab.strings[i]), i)
  return chosen


def _segment(data: bytes, pieces: dict[bytes, int], longest: int) -> tuple[list[int], bool]:
  """Greedy longest-match segmentation of `data` over `pieces`, and whether it spells all of `data`: a
  byte no piece starts with is dropped, as a byte-level tokenizer drops a byte missing from its
  alphabet."""
  ids, start, spelled = [], 0, True
  while start < len(data):
    for end in range(min(len(data), start + longest), start, -1):
      if data[start:end] in pieces:
        ids.append(pieces[data[start:end]])
        start = end
        break
    else:
      start, spelled = start + 1, False
  return ids, spelled


def between(target: tuple[Tokenizer, ModelConfig], draft: tuple[Tokenizer, ModelConfig]) -> VocabMap:
  """`build` for two models given as (tokenizer, config) (a loaded model's, or `load.load_tokenizer`'s):
  their tokenizers' bytes over the ids their heads score."""
  (target_tokenizer, target_config), (draft_tokenizer, draft_config) = target, draft
  return build(token_bytes(target_tokenizer, target_config.vocab_size),
               token_bytes(draft_tokenizer, draft_config.vocab_size), draft_tokenizer)


def build(target: TokenBytes, draft: TokenBytes, draft_tokenizer: Tokenizer) -> VocabMap:
  """The intersection of `target` and `draft` and the feed table from target ids to draft ids.

  Pairs: ids with equal, non-empty bytes, one representative per byte string and side (a duplicate
  would drop or double-count the draft probability scattered onto it); special tokens pair only with
  special tokens of the same content. Feed row of target id t: its partner; else the draft tokenizer's
  own encoding of t's bytes as text when they are UTF-8 and the encoding spells exactly those bytes
  (a SentencePiece draft that prepends "▁" does not), without special tokens unless t is one; else a
  greedy longest match over the draft's normal and byte-fallback tokens. A draft vocabulary may lack
  some single bytes (SmolLM2's lacks 21, e.g. 0x04 and 0xC0): they are dropped from the row, as the
  draft's own tokenizer drops them, and `spelled_V` is False. A row left empty, and that of an
  UNDEFINED target id (never committed by a model that does not emit it), is the draft's first stop
  id (0 without one): what the draft reads changes its proposals, never the exactness of the output."""
  target_size, draft_size = len(target.strings), len(draft.strings)
  draft_order = _by_preference(draft)
  target_chosen = _representatives(target, _by_preference(target))
  pairs = sorted(
      (d, target_chosen[key]) for key, d in _representatives(draft, draft_order).items() if key in target_chosen)
  pairs_Ix2 = np.array(pairs, np.int32).reshape(-1, 2)
  draft_ids_I, target_ids_I = pairs_Ix2[:, 0].copy(), pairs_Ix2[:, 1].copy()
  target_to_draft_V = np.full(target_size, -1, np.int32)
  target_to_draft_V[target_ids_I] = draft_ids_I

  rows: list[list[int] | None] = [None] * target_size
  spelled_V = target.kind_V != UNDEFINED
  texts = {}
  for t in range(target_size):
    if target_to_draft_V[t] >= 0:
      rows[t] = [int(target_to_draft_V[t])]
    elif target.kind_V[t] == UNDEFINED:
      rows[t] = []
    else:
      try:
        texts[t] = target.strings[t].decode()
      except UnicodeDecodeError:
        pass
  encodings = draft_tokenizer.backend.encode_batch_fast(list(texts.values()), add_special_tokens=False)
  for t, encoding in zip(texts, encodings):
    ids = encoding.ids
    kinds = [draft.kind_V[i] if i < draft_size else UNDEFINED for i in ids]
    allowed = UNDEFINED not in kinds and (SPECIAL not in kinds or target.kind_V[t] == SPECIAL)
    if allowed and b"".join(draft.strings[i] for i in ids) == target.strings[t]:
      rows[t] = ids

  pieces = {}
  for i in draft_order[draft.kind_V[draft_order] == NORMAL].tolist():
    pieces.setdefault(draft.strings[i], i)
  longest = max(map(len, pieces), default=0)
  fallback = draft_tokenizer.eos_ids[0] if draft_tokenizer.eos_ids else 0
  for t in range(target_size):
    if rows[t] is None:
      rows[t], spelled_V[t] = _segment(target.strings[t], pieces, longest)
    rows[t] = rows[t] or [fallback]

  feed_counts_V = np.array([len(row) for row in rows], np.int32)
  feed_VxM = np.zeros((target_size, int(feed_counts_V.max(initial=1))), np.int32)
  for t, row in enumerate(rows):
    feed_VxM[t, :len(row)] = row
  return VocabMap(draft_ids_I, target_ids_I, target_to_draft_V, feed_VxM, feed_counts_V, spelled_V)
