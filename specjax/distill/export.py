"""Exporting a (distilled) model as a Hugging Face directory: config.json, model.safetensors, tokenizer.

`transformers.AutoModelForCausalLM.from_pretrained(directory)` loads it with logits equal to specjax's,
and `specjax.models.hf.load_hf_dir` reads it back, so the draft serves in other stacks and as a specjax
draft alike. Names and layouts come from the inverse mapping in `specjax.models.hf`.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from specjax.models import hf
from specjax.models.config import ModelConfig
from specjax.models.layout import to_layout
from specjax.models.tokenizer import Tokenizer
from specjax.models.transformer import Params


def export_hf(directory: str, config: ModelConfig, params: Params, tokenizer: Tokenizer | None = None,
              max_positions: int = 4096) -> str:
  """Writes the model (and `tokenizer`, when given) to `directory`; returns its absolute path.

  Weights are stored in float32 (bfloat16 params are widened: safetensors' numpy writer has no
  bfloat16), one tensor per layer whichever layout `params` has (stacked ones are split). The tokenizer
  becomes `tokenizer.json` + `tokenizer_config.json` (special tokens, chat template) and its stop ids the
  config's `eos_token_id` / `bos_token_id`.
  """
  path = os.path.abspath(directory)
  os.makedirs(path, exist_ok=True)
  config = config.replace(scan_layers=False)  # Hugging Face names one tensor per layer
  params = to_layout(config, params)
  hf_config = hf.config_to_hf_dict(config.replace(dtype="float32"), max_positions)
  if tokenizer is not None:
    _write_tokenizer(path, tokenizer)
    eos = list(tokenizer.eos_ids)
    hf_config.update(eos_token_id=eos[0] if len(eos) == 1 else eos or None, bos_token_id=tokenizer.bos_id)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  tensors = {
      name: np.ascontiguousarray(array, np.float32) for name, array in hf.params_to_hf_tensors(config, params).items()
  }
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  return path


def _write_tokenizer(path: str, tokenizer: Tokenizer) -> None:
  tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
  tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens}
  if tokenizer.chat_template is not None:
    tokenizer_config["chat_template"] = tokenizer.chat_template
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(tokenizer_config, f, indent=2)
