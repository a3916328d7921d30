"""The tiny target the distillation tests train against: a random 2-layer model of `tests.tiny_hf` plus
a character-level tokenizer of exactly its vocabulary, saved as a Hugging Face directory that
`specjax.models.load.load_model` (and `transformers`) read like a real checkpoint."""

import json
import os
import string

import tokenizers

from specjax.models.load import load_model
from tests.tiny_hf import VOCAB, save_hf_model

EOS = "<|endoftext|>"


def tiny_tokenizer() -> tokenizers.Tokenizer:
  """EOS, UNK and 95 single characters (no merges): VOCAB ids, any text encodes."""
  chars = (" \n" + string.ascii_letters + string.digits + string.punctuation)[:VOCAB - 2]
  vocab = {EOS: 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>"))
  backend.add_special_tokens([EOS])
  backend.decoder = tokenizers.decoders.Fuse()
  return backend


def save_tiny_target(directory: str, family: str = "llama", seed: int = 0) -> str:
  save_hf_model(family, directory, seed)
  for name in ("config.json", "generation_config.json"):  # the families' default ids are characters here
    with open(os.path.join(directory, name)) as f:
      config = json.load(f)
    with open(os.path.join(directory, name), "w") as f:
      json.dump({**config, "eos_token_id": 0, "bos_token_id": None}, f)
  tiny_tokenizer().save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": EOS, "unk_token": "<unk>"}, f)
  return directory


def test_tiny_target_loads_with_its_tokenizer(tmp_path):
  model = load_model(save_tiny_target(str(tmp_path)))
  assert model.config.vocab_size == model.tokenizer.vocab_size == VOCAB
  assert model.tokenizer.eos_ids == (0,)
  text = "def f(x):\n    return x + 1  # ok"
  assert model.tokenizer.decode(model.tokenizer.encode(text)) == text
