"""The vocabulary map between two tokenizers (token-level intersection and feed table).

Six tiny tokenizers with different vocabularies: byte-level BPEs in the Qwen2 (read back from GGUF, with
UNUSED padding rows), SmolLM and GPT-2 styles, one trained on another corpus with a padded head, and
SentencePiece-style BPEs with byte fallback as Gemma's (no prefix space) and Llama 2's (prefix "▁").
Every ordered pair is mapped. The real pairs (Qwen2.5-Coder-1.5B with SmolLM2-135M or Gemma-3-270M GGUF files)
run with the real-model tests (SPECJAX_REAL_MODEL_TESTS=1) when both files are installed.
"""

import collections
import itertools
import os
import time

import numpy as np
import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from specjax.models import registry
from specjax.models import tokenizer as tok
from specjax.models import vocab_map
from specjax.models.tokenizer import Tokenizer
from specjax.models.vocab_map import ADDED, SPECIAL, UNDEFINED
from tests.helpers.tokenizers import (NUM_PADDING, OTHER_SOURCES, SP_ADDED, SP_SPECIALS, SPECIALS, USER_DEFINED,
                                      sample_texts, train_sentencepiece, train_tokenizer, write_gguf_tokenizer)

HEAD_PADDING = 5  # rows of "other"'s model head beyond its tokenizer


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory):
  """name -> (Tokenizer, its TokenBytes)."""
  path = str(tmp_path_factory.mktemp("vocab_map") / "qwen2.gguf")
  write_gguf_tokenizer(train_tokenizer("qwen2"), path, "qwen2")
  backends = {
      "smollm": train_tokenizer("smollm"), "sp": train_sentencepiece(prefix_space=False),
      "sp_prefix": train_sentencepiece(prefix_space=True)
  }
  stop = {"smollm": SPECIALS[2], "sp": "<eos>", "sp_prefix": "<eos>"}
  tokenizers_ = {
      name: Tokenizer(backend, [backend.token_to_id(stop[name])], None, {}) for name, backend in backends.items()
  }
  tokenizers_ |= {
      "qwen2": Tokenizer.from_gguf(path), "gpt2": Tokenizer(train_tokenizer("gpt2"), [], None, {}),
      "other": Tokenizer(train_tokenizer("gpt2", OTHER_SOURCES, 900), [], None, {})
  }
  return {
      name: (t, vocab_map.token_bytes(t, t.vocab_size + HEAD_PADDING * (name == "other")))
      for name, t in tokenizers_.items()
  }


@pytest.fixture(scope="module")
def maps(vocabularies):
  """(target name, draft name) -> VocabMap, for every ordered pair of different tokenizers."""
  return {(target, draft): vocab_map.build(vocabularies[target][1], vocabularies[draft][1], vocabularies[draft][0])
          for target, draft in itertools.permutations(vocabularies, 2)}


@pytest.mark.parametrize("name", ["qwen2", "smollm", "gpt2", "other", "sp", "sp_prefix"])
def test_token_bytes_spell_what_the_tokenizer_encodes(vocabularies, name):
  tokenizer, vocab = vocabularies[name]
  texts = sample_texts()
  if name == "sp_prefix":  # Llama 2 prepends "▁" to every text between added tokens: texts without them
    texts = [t for t in texts if not any(s in t for s in SPECIALS + USER_DEFINED)]
  assert len(texts) > 40
  for text in texts:
    ids = tokenizer.encode(text, add_special_tokens=False)
    want = (" " + text if name == "sp_prefix" else text).encode()
    assert b"".join(vocab.strings[i] for i in ids) == want, text


def test_token_bytes_kinds(vocabularies):
  qwen2, qwen2_vocab = vocabularies["qwen2"]
  ids = qwen2.backend.get_vocab(with_added_tokens=True)
  assert [qwen2_vocab.kind_V[ids[t]] for t in SPECIALS + USER_DEFINED] == [SPECIAL] * 3 + [ADDED]
  assert len(qwen2.unused_ids) == NUM_PADDING
  assert all(qwen2_vocab.kind_V[i] == UNDEFINED and qwen2_vocab.strings[i] == b"" for i in qwen2.unused_ids)
  assert np.count_nonzero(qwen2_vocab.kind_V == UNDEFINED) == NUM_PADDING
  other, other_vocab = vocabularies["other"]
  assert len(other_vocab.strings) == other.vocab_size + HEAD_PADDING
  assert list(other_vocab.kind_V[other.vocab_size:]) == [UNDEFINED] * HEAD_PADDING
  assert other_vocab.strings[other.vocab_size:] == [b""] * HEAD_PADDING
  sp, sp_vocab = vocabularies["sp"]
  for byte in (0x00, 0x61, 0xC3, 0xFF):
    i = sp.backend.token_to_id(f"<0x{byte:02X}>")
    assert sp_vocab.strings[i] == bytes([byte]) and sp_vocab.byte_fallback_V[i] and sp_vocab.kind_V[i] == 0
  assert np.count_nonzero(sp_vocab.byte_fallback_V) == 256
  assert sp_vocab.strings[sp.backend.token_to_id("▁a")] == b" a"
  assert sp_vocab.kind_V[sp.backend.token_to_id("<unk>")] == SPECIAL
  assert [sp_vocab.kind_V[sp.backend.token_to_id(t)] for t in SP_SPECIALS + SP_ADDED] == [SPECIAL] * 4 + [ADDED]


def test_unmappable_tokenizers_raise():
  wordpiece = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
  with pytest.raises(ValueError, match="WordPiece"):
    vocab_map.token_bytes(Tokenizer(wordpiece, [], None, {}), 3)
  plain = tokenizers.Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
  plain.pre_tokenizer = pre_tokenizers.Whitespace()  # pieces with no byte meaning: neither alphabet
  with pytest.raises(ValueError, match="BPE"):
    vocab_map.token_bytes(Tokenizer(plain, [], None, {}), 3)


def test_intersection_is_one_to_one_over_preferred_ids(vocabularies, maps):
  """Pairs hold equal non-empty bytes, specials only with specials; each byte string is represented by
  its normal id before an added one before a byte-fallback one, then the smallest id; every byte string
  both vocabularies hold is paired."""
  for (target, draft), m in maps.items():
    sides = vocabularies[draft][1], vocabularies[target][1]
    assert np.all(np.diff(m.draft_ids_I) > 0) and len(set(m.target_ids_I.tolist())) == m.size
    np.testing.assert_array_equal(m.target_to_draft_V[m.target_ids_I], m.draft_ids_I)
    assert np.count_nonzero(m.target_to_draft_V >= 0) == m.size
    preferred = []
    for vocab in sides:
      groups = collections.defaultdict(list)
      for i, (string, kind) in enumerate(zip(vocab.strings, vocab.kind_V)):
        if kind != UNDEFINED:
          groups[(kind == SPECIAL, string)].append(i)
      preferred.append({
          key: min(ids, key=lambda i: (vocab.byte_fallback_V[i], vocab.kind_V[i] == ADDED, i))
          for key, ids in groups.items()
      })
    want = sorted((d, preferred[1][key]) for key, d in preferred[0].items() if key in preferred[1])
    assert list(zip(m.draft_ids_I.tolist(), m.target_ids_I.tolist())) == want, (target, draft)
    assert all(sides[0].strings[d] and sides[0].strings[d] == sides[1].strings[t] and
               (sides[0].kind_V[d] == SPECIAL) == (sides[1].kind_V[t] == SPECIAL)
               for d, t in zip(m.draft_ids_I, m.target_ids_I))
    assert m.size > 200


def test_specials_pair_only_with_specials(vocabularies, maps):
  """<|im_end|> is special in both; <tool_call> is special only in sp, <|endoftext|> only in gpt2."""
  sp, gpt2 = vocabularies["sp"][0].backend, vocabularies["gpt2"][0].backend
  to_gpt2, to_sp = maps[("sp", "gpt2")], maps[("gpt2", "sp")]
  assert to_gpt2.target_to_draft_V[sp.token_to_id("<|im_end|>")] == gpt2.token_to_id("<|im_end|>")
  for token in ("<tool_call>", "<|endoftext|>"):
    assert to_gpt2.target_to_draft_V[sp.token_to_id(token)] == -1
    assert to_sp.target_to_draft_V[gpt2.token_to_id(token)] == -1


def test_duplicates_resolve_to_the_preferred_id(vocabularies, maps):
  sp, gpt2 = vocabularies["sp"][0].backend, vocabularies["gpt2"][0].backend
  gpt2_vocab = vocabularies["gpt2"][1]
  # SentencePiece holds both the piece "a" and <0x61>: only the piece is paired, <0x61> is fed as "a"
  assert maps[("sp", "gpt2")].target_to_draft_V[sp.token_to_id("a")] == gpt2.token_to_id("a")
  assert maps[("sp", "gpt2")].target_to_draft_V[sp.token_to_id("<0x61>")] == -1
  assert maps[("gpt2", "sp")].target_to_draft_V[gpt2.token_to_id("a")] == sp.token_to_id("a")
  assert maps[("sp", "sp_prefix")].feed_VxM[sp.token_to_id("<0x61>"), 0] == sp.token_to_id("a")
  # an added "$" (no "$" piece) and <0x24>: the added token
  backend = train_sentencepiece(prefix_space=False)
  assert backend.token_to_id("$") is None
  backend.add_tokens([AddedToken("$", normalized=False)])
  dollar, dollar_byte, gpt2_dollar = backend.token_to_id("$"), backend.token_to_id("<0x24>"), gpt2.token_to_id("$")
  with_dollar = Tokenizer(backend, [], None, {})
  vocab = vocab_map.token_bytes(with_dollar, with_dollar.vocab_size)
  assert vocab.strings[dollar] == vocab.strings[dollar_byte] == b"$"
  assert vocab_map.build(gpt2_vocab, vocab, with_dollar).target_to_draft_V[gpt2_dollar] == dollar
  back = vocab_map.build(vocab, gpt2_vocab, vocabularies["gpt2"][0]).target_to_draft_V
  assert back[dollar] == gpt2_dollar and back[dollar_byte] == -1
  # a normal and an added token with the same bytes ("Ġreturn" and " return"): the normal one (the same
  # training as gpt2's: the same ids)
  backend = train_tokenizer("gpt2")
  normal = backend.token_to_id("Ġreturn")
  backend.add_tokens([AddedToken(" return", normalized=False)])
  added = backend.token_to_id(" return")
  assert normal is not None and added is not None and normal != added
  duplicated = Tokenizer(backend, [], None, {})
  vocab = vocab_map.token_bytes(duplicated, duplicated.vocab_size)
  assert vocab.strings[added] == vocab.strings[normal] == b" return"
  forth = vocab_map.build(gpt2_vocab, vocab, duplicated)
  assert forth.target_to_draft_V[normal] == normal and added not in forth.draft_ids_I
  back = vocab_map.build(vocab, gpt2_vocab, vocabularies["gpt2"][0])
  assert back.target_to_draft_V[normal] == normal and back.target_to_draft_V[added] == -1
  assert back.feed_counts_V[added] == 1 and back.feed_VxM[added, 0] == normal
  # two normal tokens with the same bytes (" a" has a character outside the byte alphabet: as UTF-8): the
  # smaller id is paired; "Ġa" is still fed as itself, the draft's own encoding of " a"
  backend = tokenizers.Tokenizer(models.BPE({"a": 0, "Ġ": 1, " a": 2, "Ġa": 3}, [("Ġ", "a")]))
  backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
  twice = Tokenizer(backend, [], None, {})
  vocab = vocab_map.token_bytes(twice, 4)
  assert vocab.strings == [b"a", b" ", b" a", b" a"]
  itself = vocab_map.build(vocab, vocab, twice)
  assert itself.target_to_draft_V.tolist() == [0, 1, 2, -1] and itself.feed_VxM[3].tolist() == [3]


def test_feed_prefers_the_draft_encoding(vocabularies, maps):
  """A target token without a partner is fed as the draft tokenizer encodes its text when that spells
  it (always between these two byte-level tokenizers without normalizers)."""
  target_vocab, (draft, _) = vocabularies["gpt2"][1], vocabularies["other"]
  m = maps[("gpt2", "other")]
  unpaired = [t for t in range(len(target_vocab.strings)) if m.target_to_draft_V[t] < 0]
  texts = [target_vocab.strings[t].decode("utf-8", "ignore") for t in unpaired]
  fed = [(m.feed_VxM[t, :m.feed_counts_V[t]].tolist(), draft.encode(text, add_special_tokens=False))
         for t, text in zip(unpaired, texts)
         if text.encode() == target_vocab.strings[t]]
  assert len(fed) > 50 and all(row == ids for row, ids in fed)


def test_feed_rows_spell_every_target_id(vocabularies, maps):
  for (target, draft), m in maps.items():
    target_vocab = vocabularies[target][1]
    draft_tokenizer, draft_vocab = vocabularies[draft]
    fallback = draft_tokenizer.eos_ids[0] if draft_tokenizer.eos_ids else 0
    assert m.feed_VxM.shape == (len(target_vocab.strings), m.max_feed) and m.feed_VxM.dtype == np.int32
    assert m.max_feed == m.feed_counts_V.max() and m.feed_counts_V.min() >= 1
    np.testing.assert_array_equal(m.spelled_V, target_vocab.kind_V != UNDEFINED)
    for t, (string, kind, count) in enumerate(zip(target_vocab.strings, target_vocab.kind_V, m.feed_counts_V)):
      row = m.feed_VxM[t, :count].tolist()
      assert not m.feed_VxM[t, count:].any()
      if kind == UNDEFINED:
        assert row == [fallback], (target, draft, t)
        continue
      assert b"".join(draft_vocab.strings[i] for i in row) == string, (target, draft, t)
      assert all(draft_vocab.kind_V[i] != UNDEFINED and (kind == SPECIAL or draft_vocab.kind_V[i] != SPECIAL)
                 for i in row), (target, draft, t)
      if m.target_to_draft_V[t] >= 0:
        assert row == [m.target_to_draft_V[t]]


def test_rows_the_draft_cannot_encode_are_longest_matches(vocabularies, maps):
  """A draft that prepends "▁" never encodes a normal target token's text to its exact bytes: each
  unpaired row takes, at every position, the longest normal draft piece the remaining bytes begin with."""
  target_vocab, draft_vocab = vocabularies["gpt2"][1], vocabularies["sp_prefix"][1]
  m = maps[("gpt2", "sp_prefix")]
  pieces = {s for s, kind in zip(draft_vocab.strings, draft_vocab.kind_V) if kind == 0}
  unpaired = [t for t in range(len(target_vocab.strings)) if m.target_to_draft_V[t] < 0 and target_vocab.kind_V[t] == 0]
  assert len(unpaired) > 100 and m.max_feed > 1
  for t in unpaired:
    string, start = target_vocab.strings[t], 0
    for i in m.feed_VxM[t, :m.feed_counts_V[t]]:
      piece = draft_vocab.strings[i]
      assert draft_vocab.kind_V[i] == 0 and string.startswith(piece, start), t
      assert not any(string[start:end] in pieces for end in range(start + len(piece) + 1, len(string) + 1)), t
      start += len(piece)


def test_bytes_the_draft_lacks_are_dropped(vocabularies):
  """A draft without byte fallback holding only "e", "r", " " and "er": a target token's other bytes
  are dropped from its row (the draft's stop id when none is left) and it is not spelled."""
  draft = Tokenizer(tok._gemma_sentencepiece(["<unk>", "e", "r", "▁", "er", "<eos>"]), [5], None, {})
  draft_vocab = vocab_map.token_bytes(draft, draft.vocab_size)
  target_vocab = vocabularies["gpt2"][1]
  m = vocab_map.build(target_vocab, draft_vocab, draft)
  assert m.size == 4  # "e", "r", " " and "er"
  for t, string in enumerate(target_vocab.strings):
    kept = bytes(c for c in string if c in b"er ")
    row = m.feed_VxM[t, :m.feed_counts_V[t]].tolist()
    assert m.spelled_V[t] == (kept == string)
    assert row == [5] if not kept else b"".join(draft_vocab.strings[i] for i in row) == kept


def test_coverage_and_a_vocabulary_onto_itself(vocabularies, maps):
  tokenizer, vocab = vocabularies["gpt2"]
  itself = vocab_map.build(vocab, vocab, tokenizer)
  np.testing.assert_array_equal(itself.target_to_draft_V, np.arange(len(vocab.strings)))
  assert itself.max_feed == 1
  counts_V = np.zeros(len(vocab.strings), np.int64)
  for text in sample_texts():
    np.add.at(counts_V, tokenizer.encode(text, add_special_tokens=False), 1)
  assert itself.coverage(counts_V) == 1.0
  m = maps[("gpt2", "other")]
  want = counts_V[m.target_to_draft_V >= 0].sum() / counts_V.sum()
  assert m.coverage(counts_V) == pytest.approx(want) and 0.3 < want < 1.0
  assert m.coverage(np.zeros_like(counts_V)) == 0.0


def test_build_is_deterministic(vocabularies, maps):
  again = vocab_map.build(vocabularies["qwen2"][1], vocabularies["sp_prefix"][1], vocabularies["sp_prefix"][0])
  first = maps[("qwen2", "sp_prefix")]
  for field in ("draft_ids_I", "target_ids_I", "target_to_draft_V", "feed_VxM", "feed_counts_V", "spelled_V"):
    np.testing.assert_array_equal(getattr(again, field), getattr(first, field))


# (draft, its vocabulary size, target ids Qwen's feed cannot spell, ids the draft's feed cannot spell): SmolLM2's
# vocabulary lacks 21 single bytes; Gemma's byte fallback spells every byte.
REAL_DRAFTS = [("smollm2-135m-instruct", 49_152, 21, 0), ("gemma-3-270m", 262_144, 0, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("draft_name,draft_size,unspelled_by_draft,unspelled_by_qwen", REAL_DRAFTS)
def test_real_pair_with_qwen_coder(draft_name, draft_size, unspelled_by_draft, unspelled_by_qwen):
  """Qwen2.5-Coder-1.5B (151,936 ids) <-> a real draft of another family, both directions: every id of the
  target spelled by its feed row (decoded back to the target id's bytes), except the bytes the draft lacks
  and padding rows. Opt-in, as every real-model test (20-40 s each, most of it reading the GGUF tokenizers)."""
  if os.environ.get("SPECJAX_REAL_MODEL_TESTS") != "1":
    pytest.skip("real-model tests are opt-in: set SPECJAX_REAL_MODEL_TESTS=1")
  paths = [registry.model_path(registry.get_spec(name)) for name in ("qwen2.5-coder-1.5b-instruct", draft_name)]
  if not all(os.path.isfile(p) for p in paths):
    pytest.skip(f"needs both {paths}")
  qwen, other = (Tokenizer.from_gguf(p) for p in paths)
  assert other.vocab_size == draft_size
  vocabs = {
      "qwen": (qwen, vocab_map.token_bytes(qwen, qwen.vocab_size)),
      "other": (other, vocab_map.token_bytes(other, other.vocab_size))
  }
  directions = (("qwen", "other", unspelled_by_draft), ("other", "qwen", unspelled_by_qwen))
  for target, draft, unspelled_expected in directions:
    target_vocab, (draft_tokenizer, draft_vocab) = vocabs[target][1], vocabs[draft]
    start = time.perf_counter()
    m = vocab_map.build(target_vocab, draft_vocab, draft_tokenizer)
    seconds = time.perf_counter() - start
    counts_V = np.zeros(len(target_vocab.strings), np.int64)
    for text in sample_texts():
      np.add.at(counts_V, vocabs[target][0].encode(text, add_special_tokens=False), 1)
    print(f"{target} <- {draft} ({draft_name}): I = {m.size}, M = {m.max_feed}, build {seconds:.1f} s, "
          f"not spelled {np.count_nonzero(~m.spelled_V)}, coverage of sample texts {m.coverage(counts_V):.3f}")
    assert 30_000 < m.size < min(qwen.vocab_size, draft_size) and 1 < m.max_feed <= 32 and seconds < 30
    for t in range(len(target_vocab.strings)):
      string, row = target_vocab.strings[t], m.feed_VxM[t, :m.feed_counts_V[t]].tolist()
      if m.spelled_V[t]:
        assert b"".join(draft_vocab.strings[i] for i in row) == string, t
      else:
        assert target_vocab.kind_V[t] == UNDEFINED or len(string) == 1, t
        assert row == [draft_tokenizer.eos_ids[0]] and t not in m.target_ids_I
    unspelled = np.count_nonzero(~m.spelled_V) - np.count_nonzero(target_vocab.kind_V == UNDEFINED)
    assert unspelled == unspelled_expected
