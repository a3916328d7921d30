"""Tokenizers from HF directories and from GGUF metadata, against `transformers` and `tokenizers`.

A tiny byte-level BPE is trained offline in each pre-tokenizer style a registry model uses (Qwen2's
split regex with NFC, SmolLM's single digits, plain GPT-2), saved as an HF directory and written as GGUF
metadata the way llama.cpp's converter does (special tokens CONTROL, added ones USER_DEFINED, padding
rows UNUSED).
"""

import json
import os

import gguf
import pytest
import tokenizers
import transformers

from specjax.models.tokenizer import Tokenizer
from tests.helpers.tokenizers import (NUM_PADDING, STYLES, TEXTS, save_hf_dir, train_tokenizer, write_gguf_tokenizer)


@pytest.fixture(scope="module", params=list(STYLES))
def tiny(request, tmp_path_factory):
  """(style, directory with tokenizer.json and tok.gguf, the trained tokenizers.Tokenizer)."""
  directory = str(tmp_path_factory.mktemp(request.param))
  backend = train_tokenizer(request.param)
  save_hf_dir(backend, directory)
  write_gguf_tokenizer(backend, os.path.join(directory, "tok.gguf"), request.param)
  return request.param, directory, backend


def test_gguf_and_hf_dir_encode_like_the_original(tiny):
  _, directory, original = tiny
  from_gguf = Tokenizer.from_gguf(os.path.join(directory, "tok.gguf"))
  from_dir = Tokenizer.from_hf_dir(directory)
  for text in TEXTS:
    want = original.encode(text).ids
    assert from_gguf.encode(text) == want
    assert from_dir.encode(text) == want
    assert from_gguf.decode(want) == from_dir.decode(want) == original.decode(want, skip_special_tokens=False)
  assert from_gguf.fingerprint() == from_dir.fingerprint()
  assert from_gguf.vocab_size == from_dir.vocab_size + NUM_PADDING


def test_matches_transformers_conversions(tiny):
  """transformers' GGUF conversion knows no SmolLM digit split (it falls back to GPT-2's regex), so
  that style is checked against its own tokenizer.json only (previous test)."""
  style, directory, _ = tiny
  ours = Tokenizer.from_gguf(os.path.join(directory, "tok.gguf"))
  references = [transformers.AutoTokenizer.from_pretrained(directory)]
  if style != "smollm":
    references.append(transformers.AutoTokenizer.from_pretrained(directory, gguf_file="tok.gguf"))
  for reference in references:
    for text in TEXTS:
      ids = reference.encode(text)
      assert ours.encode(text) == ids, text
      assert ours.decode(ids) == reference.decode(ids)
      assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list."}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages, tokenize=False,
                                                                               add_generation_prompt=True)


def test_special_ids_and_chat_prompt(tiny):
  _, directory, original = tiny
  vocab = original.get_vocab(with_added_tokens=True)
  for t in (Tokenizer.from_gguf(os.path.join(directory, "tok.gguf")), Tokenizer.from_hf_dir(directory)):
    assert t.eos_ids == tuple(sorted((vocab["<|im_end|>"], vocab["<|endoftext|>"])))
    assert t.bos_id is None
    assert t.apply_chat_template("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert t.encode("<|im_end|>") == [vocab["<|im_end|>"]]


def test_round_trip_through_dict(tiny):
  _, directory, _ = tiny
  t = Tokenizer.from_gguf(os.path.join(directory, "tok.gguf"))
  copy = Tokenizer.from_dict(json.loads(json.dumps(t.to_dict())))
  assert copy.fingerprint() == t.fingerprint() and copy.eos_ids == t.eos_ids
  assert [copy.encode(x) for x in TEXTS] == [t.encode(x) for x in TEXTS]


def test_fingerprint_sees_a_changed_token(tmp_path):
  backend = train_tokenizer("gpt2")
  write_gguf_tokenizer(backend, str(tmp_path / "a.gguf"), "gpt2")
  backend.add_special_tokens([tokenizers.AddedToken("<|new|>", special=True)])
  save_hf_dir(backend, str(tmp_path))
  assert Tokenizer.from_hf_dir(str(tmp_path)).fingerprint() != Tokenizer.from_gguf(str(tmp_path /
                                                                                       "a.gguf")).fingerprint()


def test_bos_added_when_the_file_says_so(tmp_path):
  path = str(tmp_path / "bos.gguf")
  writer = gguf.GGUFWriter(path, "llama")
  writer.add_tokenizer_model("gpt2")
  writer.add_token_list(["<s>", "a", "b", "ab"])
  writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * 3)
  writer.add_token_merges(["a b"])
  writer.add_bos_token_id(0)
  writer.add_add_bos_token(True)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  t = Tokenizer.from_gguf(path)
  assert t.bos_id == 0 and t.encode("abab") == [0, 3, 3] and t.encode("ab", add_special_tokens=False) == [3]
  with pytest.raises(ValueError, match="no chat template"):
    t.apply_chat_template("hi")


def test_unsupported_gguf_tokenizers(tmp_path):
  for key, value, message in [("model", "llama", "unsupported GGUF tokenizer model 'llama'"),
                              ("pre", "mystery", "pre-tokenizer")]:
    path = str(tmp_path / f"{key}.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(value if key == "model" else "gpt2")
    if key == "pre":
      writer.add_tokenizer_pre(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=message):
      Tokenizer.from_gguf(path)


def test_gemma_sentencepiece_gguf_matches_transformers(tmp_path):
  """A tiny Gemma 3 GGUF vocabulary (no merges, byte fallback, a control token, a user-defined run of
  spaces stored as spaces): specjax rebuilds the tokenizer transformers builds from the same file."""
  pieces = ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "bc", "\u2581abc", "ca", "  "]
  tokens = (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>"] + [f"<0x{i:02X}>" for i in range(256)] +
            pieces)
  types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 1) + [4]
  path = str(tmp_path / "g.gguf")
  writer = gguf.GGUFWriter(path, "gemma3")
  writer.add_tokenizer_model("llama")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(tokens)
  writer.add_token_scores([0.0] * len(tokens))
  writer.add_token_types(types)
  writer.add_bos_token_id(2)
  writer.add_eos_token_id(1)
  writer.add_unk_token_id(3)
  writer.add_pad_token_id(0)
  writer.add_add_bos_token(True)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  ours = Tokenizer.from_gguf(path)
  reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="g.gguf")
  for text in ["abc abcab", "  a  bc", "<start_of_turn>ca\u00e9 d\n", "cabc"]:
    ids = reference.encode(text)
    assert ours.encode(text) == ids, text
    assert ours.decode(ids) == reference.decode(ids)
  assert ours.eos_ids == (1,)
