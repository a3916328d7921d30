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
from tokenizers import normalizers, pre_tokenizers

from specjax.models import tokenizer as tok
from specjax.models.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool_call>"]
NUM_PADDING = 3
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
                 " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = [
    "def add(a, b):\n    return a + b  # 12345 + 3.14\n\n\n",
    "table = [\n    1,  22,   333,\n        4444]",
    "naïve café – 日本語 😀  trailing spaces   ",
    "<|im_start|>user\nWrite `x = [i**2 for i in range(10)]`<|im_end|>\n<|im_start|>assistant\n",
    "It's they'll WE'RE  \t tabs\r\nand <tool_call>{\"name\": 1}<|endoftext|>",
]
STYLES = {  # GGUF pre name -> (normalizer, pre-tokenizer) of the model's tokenizer.json
    "qwen2": (normalizers.NFC(), pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(tok._QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
    "smollm": (None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False)])),
    "gpt2": (None, pre_tokenizers.ByteLevel(add_prefix_space=False)),
}


def train_tokenizer(style: str) -> tokenizers.Tokenizer:
  normalizer, pre_tokenizer = STYLES[style]
  backend = tokenizers.Tokenizer(tokenizers.models.BPE())
  if normalizer is not None:
    backend.normalizer = normalizer
  backend.pre_tokenizer = pre_tokenizer
  backend.decoder = tokenizers.decoders.ByteLevel()
  corpus = [open(json.__file__.replace("__init__", name)).read() for name in ("__init__", "decoder", "encoder")]
  corpus += TEXTS * 3
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  backend.train_from_iterator(corpus, trainer)
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIALS])
  backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in USER_DEFINED])
  return backend


def save_hf_dir(backend: tokenizers.Tokenizer, directory: str) -> None:
  backend.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
               "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
               "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def add_tokenizer_metadata(writer: gguf.GGUFWriter, backend: tokenizers.Tokenizer, pre: str) -> None:
  """Tokenizer metadata as llama.cpp's converter writes it."""
  vocab = backend.get_vocab(with_added_tokens=True)
  tokens = sorted(vocab, key=vocab.get) + [f"[PAD{len(vocab) + i}]" for i in range(NUM_PADDING)]
  kinds = {t: gguf.TokenType.CONTROL for t in SPECIALS} | {t: gguf.TokenType.USER_DEFINED for t in USER_DEFINED}
  types = [kinds.get(t, gguf.TokenType.NORMAL) for t in tokens[:len(vocab)]]
  types += [gguf.TokenType.UNUSED] * NUM_PADDING
  merges = json.loads(backend.to_str())["model"]["merges"]
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_types(types)
  writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
  writer.add_eos_token_id(vocab["<|im_end|>"])
  writer.add_bos_token_id(vocab["<|endoftext|>"])
  writer.add_pad_token_id(vocab["<|endoftext|>"])
  writer.add_add_bos_token(False)
  writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf_tokenizer(backend: tokenizers.Tokenizer, path: str, pre: str) -> None:
  """A GGUF file holding only tokenizer metadata (no tensors needed)."""
  writer = gguf.GGUFWriter(path, "qwen2")
  add_tokenizer_metadata(writer, backend, pre)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


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
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


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
  assert Tokenizer.from_hf_dir(str(tmp_path)).fingerprint() != Tokenizer.from_gguf(
      str(tmp_path / "a.gguf")).fingerprint()


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
  for key, value, message in [("model", "llama", "unsupported GGUF tokenizer model 'llama'"), ("pre", "mystery", "pre-tokenizer")]:
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
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
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
