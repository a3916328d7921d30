"""Tiny random `transformers` models of every supported family, saved offline with `save_pretrained`.

The RoPE-scaling variants have a short original context (8 to 16 positions) and the Gemma models a
sliding window of 6, so the parity tests' prompts (up to 23 tokens) run past both. Gemma's scalars
are chosen so that a missed feature shows in the logits: caps of 2 and 3 (Gemma 2 soft-capping bites),
a query_pre_attn_scalar of 20 (not head_dim), local and global RoPE bases 100 and 10^4 (Gemma 3), and
norm weights drawn around 0 (applied as 1 + w: read as w they would nearly zero the activations).
"""

from __future__ import annotations

import torch
import transformers

from specjax import autoregressive, testing
from specjax.generation import as_token_lists
from specjax.models.kv_cache import init_cache

# and "gemma3_llama_cpp": Gemma 3 at the defaults llama.cpp assumes for its GGUF files (tests/test_gguf.py)
FAMILIES = ("llama", "qwen2", "qwen2_tied", "mistral", "gpt2", "llama3", "llama_linear", "llama_dynamic", "llama_yarn",
            "qwen3", "gemma2", "gemma3")
ROPE_SCALINGS = {  # family -> classic `rope_scaling` of a Llama config with max_position_embeddings 16
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8},
    "llama_linear": {"rope_type": "linear", "factor": 2.0},
    "llama_dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama_yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
}
GEMMA = dict(head_dim=24, sliding_window=6, query_pre_attn_scalar=20, hidden_activation="gelu_pytorch_tanh")
VOCAB = 97


def make_hf_model(family: str, seed: int = 0, vocab: int = VOCAB) -> transformers.PreTrainedModel:
  """A random float32 model of `family` scoring `vocab` ids, small enough for a unit test on 2 cores."""
  torch.manual_seed(seed)
  common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
  if family == "llama":
    config = transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
  elif family in ROPE_SCALINGS:
    config = transformers.LlamaConfig(**{**common, "max_position_embeddings": 16}, rope_theta=10000.0,
                                      rope_scaling=dict(ROPE_SCALINGS[family]), tie_word_embeddings=family == "llama3")
  elif family == "qwen3":
    config = transformers.Qwen3Config(**common, head_dim=24, rope_theta=1e6, tie_word_embeddings=False)
  elif family == "gemma2":
    config = transformers.Gemma2Config(**common, **GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
  elif family == "gemma3_llama_cpp":  # what a Gemma 3 GGUF implies: see specjax.models.gguf_loader
    config = transformers.Gemma3TextConfig(
        **{**common, "num_hidden_layers": 7}, **{**GEMMA, "query_pre_attn_scalar": GEMMA["head_dim"]}, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}
        })
  elif family == "gemma3":
    config = transformers.Gemma3TextConfig(
        **{**common, "num_hidden_layers": 3}, **GEMMA,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
        })
  elif family in ("qwen2", "qwen2_tied"):
    config = transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=family == "qwen2_tied")
  elif family == "mistral":
    config = transformers.MistralConfig(**common, rope_theta=1e4, sliding_window=None, tie_word_embeddings=False)
  elif family == "gpt2":
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=256)
  else:
    raise ValueError(family)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  with torch.no_grad():  # larger-than-default weights so logits are not all near zero
    for name, p in model.named_parameters():
      if p.ndim == 2:
        p.normal_(0.0, 0.1)
      elif family.startswith("gemma") and "norm" in name:
        p.normal_(0.0, 0.1)
  return model.eval()


def save_hf_model(family: str, directory: str, seed: int = 0, safe: bool = True,
                  vocab: int = VOCAB) -> transformers.PreTrainedModel:
  model = make_hf_model(family, seed, vocab)
  model.save_pretrained(directory, safe_serialization=safe)
  return model


CHAT_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}<eos>{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")  # printable ASCII + <eos> only


def save_char_tokenizer(directory: str, chat_template: str | None = None) -> None:
  """A character-level `tokenizer.json` for the tiny models: id 0 `<unk>`, 1 `<eos>`, then the 95
  printable ASCII characters (97 ids = VOCAB), so text prompts can run through the real pipeline;
  `chat_template` (e.g. `CHAT_TEMPLATE`) goes into tokenizer_config.json."""
  import json
  import os

  import tokenizers

  vocab = {"<unk>": 0, "<eos>": 1, **{chr(c): 2 + i for i, c in enumerate(range(32, 127))}}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
  backend.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])
  backend.decoder = tokenizers.decoders.Fuse()
  backend.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(
        {"eos_token": "<eos>", "unk_token": "<unk>", **({"chat_template": chat_template} if chat_template else {})}, f)


# Ragged prompts longer than the windows (6) and within the dynamic RoPE's original context (16).
PARITY_PROMPTS = ([5, 17, 3, 44, 9, 8, 60, 2, 71], [1, 2, 3, 90, 33, 12, 7, 7, 8, 40, 41, 42, 43])


def assert_greedy_matches_generate(hf_model, config, params, new_tokens: int, prompts=PARITY_PROMPTS) -> None:
  """specjax's greedy decoding of `prompts` (one ragged batch) equals `transformers.generate`'s, row by row."""
  out = autoregressive.generate(config, params, testing.request(prompts, new_tokens, eos_ids=()),
                                init_cache(config, len(prompts), 32))
  for prompt, row in zip(prompts, as_token_lists(out.tokens, out.counts)):
    with torch.no_grad():
      want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert row == want
