"""Tiny byte-level BPE tokenizers, trained offline in each pre-tokenizer style a registry model uses
(Qwen2's split regex with NFC, SmolLM's single digits, plain GPT-2), saved as an HF directory or written
as GGUF metadata the way llama.cpp's converter does (special tokens CONTROL, added ones USER_DEFINED,
padding rows UNUSED); and tiny SentencePiece-style BPEs with byte fallback (Gemma's and Llama 2's)."""

import difflib
import json
import os
import textwrap

import gguf
import tokenizers
from tokenizers import normalizers, pre_tokenizers

from specjax.models import tokenizer as tok

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

JSON_SOURCES = tuple(json.__file__.replace("__init__", name) for name in ("__init__", "decoder", "encoder"))
OTHER_SOURCES = (difflib.__file__, textwrap.__file__)  # a different corpus: vocabularies that differ more
SP_SPECIALS = ["<bos>", "<eos>", "<|im_end|>", "<tool_call>"]  # <tool_call> is USER_DEFINED (not special) above
SP_ADDED = ["<|endoftext|>"]  # special in the byte-level tokenizers above


def _read(paths: tuple[str, ...]) -> list[str]:
  """The text of each file."""
  texts = []
  for path in paths:
    with open(path) as f:
      texts.append(f.read())
  return texts


def train_tokenizer(style: str, sources: tuple[str, ...] = JSON_SOURCES, vocab_size: int = 600) -> tokenizers.Tokenizer:
  """A `vocab_size`-token BPE trained on `sources` (files) and TEXTS in the pre-tokenizer `style`, with
  SPECIALS and USER_DEFINED added."""
  normalizer, pre_tokenizer = STYLES[style]
  backend = tokenizers.Tokenizer(tokenizers.models.BPE())
  if normalizer is not None:
    backend.normalizer = normalizer
  backend.pre_tokenizer = pre_tokenizer
  backend.decoder = tokenizers.decoders.ByteLevel()
  corpus = _read(sources) + TEXTS * 3
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  backend.train_from_iterator(corpus, trainer)
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIALS])
  backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in USER_DEFINED])
  return backend


def save_hf_dir(backend: tokenizers.Tokenizer, directory: str) -> None:
  """`backend` as an HF tokenizer directory (tokenizer.json, tokenizer_config.json with the chat template)."""
  backend.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(
        {
            "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
            "clean_up_tokenization_spaces": False, "tokenizer_class": "PreTrainedTokenizerFast"
        }, f)


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


def train_sentencepiece(prefix_space: bool) -> tokenizers.Tokenizer:
  """A 500-piece SentencePiece-style BPE trained on OTHER_SOURCES and TEXTS, rebuilt with
  `_gemma_sentencepiece` ("▁" for a space, byte fallback to `<0x00>`..`<0xFF>` for characters outside its
  60 most frequent, so both "a" and "<0x61>" exist); with `prefix_space`, Llama 2's variant that prepends
  "▁" to each text and strips the first space when decoding. SP_SPECIALS special, SP_ADDED added."""
  trainer_backend = tokenizers.Tokenizer(tokenizers.models.BPE())
  trainer_backend.normalizer = normalizers.Replace(" ", "▁")
  trainer_backend.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=500, limit_alphabet=60, show_progress=False)
  trainer_backend.train_from_iterator(_read(OTHER_SOURCES) + TEXTS * 3, trainer)
  vocab = trainer_backend.get_vocab()
  backend = tok._gemma_sentencepiece(["<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + sorted(vocab, key=vocab.get))
  if prefix_space:
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = tokenizers.decoders.Sequence([
        tokenizers.decoders.Replace("▁", " "),
        tokenizers.decoders.ByteFallback(),
        tokenizers.decoders.Fuse(),
        tokenizers.decoders.Strip(" ", 1, 0)
    ])
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SP_SPECIALS])
  backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in SP_ADDED])
  return backend


def write_gguf_tokenizer(backend: tokenizers.Tokenizer, path: str, pre: str) -> None:
  """A GGUF file holding only tokenizer metadata (no tensors needed)."""
  writer = gguf.GGUFWriter(path, "qwen2")
  add_tokenizer_metadata(writer, backend, pre)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def sample_texts(count: int = 40, length: int = 200) -> list[str]:
  """TEXTS and `count` slices of the json and OTHER_SOURCES files (`length` characters each)."""
  corpus = "".join(_read(JSON_SOURCES + OTHER_SOURCES))
  step = len(corpus) // count
  return TEXTS + [corpus[i * step:i * step + length] for i in range(count)]
