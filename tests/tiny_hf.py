"""Tiny random `transformers` models of every supported family, saved offline with `save_pretrained`."""

from __future__ import annotations

import torch
import transformers

FAMILIES = ("llama", "qwen2", "qwen2_tied", "mistral", "gpt2")
VOCAB = 97


def make_hf_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
  """A random float32 model of `family`, small enough for a unit test on 2 cores."""
  torch.manual_seed(seed)
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6)
  if family == "llama":
    config = transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
  elif family in ("qwen2", "qwen2_tied"):
    config = transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=family == "qwen2_tied")
  elif family == "mistral":
    config = transformers.MistralConfig(**common, rope_theta=1e4, sliding_window=None,
                                        tie_word_embeddings=False)
  elif family == "gpt2":
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256)
  else:
    raise ValueError(family)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  with torch.no_grad():  # larger-than-default weights so logits are not all near zero
    for p in model.parameters():
      if p.ndim == 2:
        p.normal_(0.0, 0.1)
  return model.eval()


def save_hf_model(family: str, directory: str, seed: int = 0, safe: bool = True) -> transformers.PreTrainedModel:
  model = make_hf_model(family, seed)
  model.save_pretrained(directory, safe_serialization=safe)
  return model


def save_char_tokenizer(directory: str) -> None:
  """A character-level `tokenizer.json` for the tiny models: id 0 `<unk>`, 1 `<eos>`, then the 95
  printable ASCII characters (97 ids = VOCAB), so text prompts can run through the real pipeline."""
  import json
  import os

  import tokenizers

  vocab = {"<unk>": 0, "<eos>": 1, **{chr(c): 2 + i for i, c in enumerate(range(32, 127))}}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
  backend.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])
  backend.decoder = tokenizers.decoders.Fuse()
  backend.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<eos>", "unk_token": "<unk>"}, f)
