"""Tiny byte-level BPE tokenizers, trained offline in each pre-tokenizer style a registry model uses
(Qwen2's split regex with NFC, SmolLM's single digits, plain GPT-2), saved as an HF directory or written
as GGUF metadata the way llama.cpp's converter does (special tokens CONTROL, added ones USER_DEFINED,
padding rows UNUSED)."""

import json
import os

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


def train_tokenizer(style: str) -> tokenizers.Tokenizer:
  """A 600-token BPE trained on the json package's sources and TEXTS in the pre-tokenizer `style`, with
  SPECIALS and USER_DEFINED added."""
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
  """`backend` as an HF tokenizer directory (tokenizer.json, tokenizer_config.json with the chat template)."""
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
