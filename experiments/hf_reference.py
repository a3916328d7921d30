"""`transformers` as the peer the benchmarks compare with: loading a model the way specjax names it, and
timed `generate` calls on the very input ids specjax decodes."""

from __future__ import annotations

import os
import time
from typing import Sequence


def hf_model(name: str, dtype: str = "float32"):
  """A `transformers` causal LM in `dtype` from an HF directory, a `.gguf` file or a registry name."""
  import transformers

  from specjax.models import registry

  if os.path.isdir(name):
    return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval()
  path = registry.model_path(registry.get_spec(name)) if name in registry.MODELS else name
  return transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=dtype).eval()


def generate(model, batch_ids: Sequence[Sequence[int]], eos_ids: Sequence[int], max_new_tokens: int,
             temperature: float = 0.0, seed: int = 0, **kwargs) -> tuple[list[list[int]], float]:
  """`generate` of a batch of prompts (left-padded), greedy or (temperature > 0) sampled from the
  whole distribution (top-k and top-p off, torch seeded with `seed`): each row's new tokens up to and
  including its first stop token, and the seconds the call took. `kwargs` go to `generate` (an
  assistant model, prompt lookup)."""
  import torch

  if temperature > 0:
    torch.manual_seed(seed)
    kwargs = {**kwargs, "temperature": temperature, "top_k": 0, "top_p": 1.0}

  width = max(len(p) for p in batch_ids)
  input_ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in batch_ids])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_ids])
  start = time.perf_counter()
  with torch.no_grad():
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                         eos_token_id=list(eos_ids), pad_token_id=0, **kwargs)
  seconds = time.perf_counter() - start
  rows = [row[:next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))] for row in out[:, width:].tolist()]
  return rows, seconds
