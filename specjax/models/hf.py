"""Loading Hugging Face checkpoint directories: `config.json` + safetensors (single or sharded) or
`pytorch_model.bin`, mapped onto specjax's parameter tree without transposes (same `[out, in]` layout).
The inverse mapping (`config_to_hf_dict`, `params_to_hf_tensors`) writes specjax models back out.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, Iterator

import jax
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.param_tree import LazyTensor, Placement, assemble_params
from specjax.models.transformer import Params

_LLAMA_FAMILY = ("llama", "qwen2", "mistral")
_LLAMA_LAYER = {
    "self_attn.q_proj": "attn/q_proj", "self_attn.k_proj": "attn/k_proj",
    "self_attn.v_proj": "attn/v_proj", "self_attn.o_proj": "attn/o_proj",
    "mlp.gate_proj": "mlp/gate_proj", "mlp.up_proj": "mlp/up_proj", "mlp.down_proj": "mlp/down_proj",
}
_GPT2_LAYER = {"attn.c_proj": "attn/o_proj", "mlp.c_fc": "mlp/up_proj", "mlp.c_proj": "mlp/down_proj"}
_GPT2_NORMS = {"ln_1": "attn_norm", "ln_2": "mlp_norm"}


def config_from_hf_dict(hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
  """ModelConfig from a `config.json` dict; raises on architectures or features we do not implement."""
  model_type = hf.get("model_type")
  if model_type in _LLAMA_FAMILY:
    rope = hf.get("rope_scaling") or {}
    rope_params = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type")) or rope_params.get("rope_type", "default")
    if rope_type != "default":
      raise ValueError(f"unsupported rope scaling {rope_type!r} in config.json (only default RoPE)")
    n_heads = hf["num_attention_heads"]
    window = hf.get("sliding_window") or 0
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
      window = 0
    return ModelConfig(
        arch="llama", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, d_ff=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_params.get("rope_theta", hf.get("rope_theta", 10000.0)),
        qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),  # transformers' default
        sliding_window=window, dtype=dtype)
  if model_type == "gpt2":
    if hf.get("activation_function", "gelu_new") != "gelu_new":
      raise ValueError(f"unsupported gpt2 activation {hf['activation_function']!r} (only gelu_new)")
    d_model, n_heads = hf["n_embd"], hf["n_head"]
    return ModelConfig(
        arch="gpt2", vocab_size=hf["vocab_size"], d_model=d_model, n_layers=hf["n_layer"],
        n_heads=n_heads, n_kv_heads=n_heads, head_dim=d_model // n_heads,
        d_ff=hf.get("n_inner") or 4 * d_model, norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        max_positions=hf["n_positions"], tie_embeddings=True, dtype=dtype)
  raise ValueError(f"unsupported architecture model_type={model_type!r}; "
                   f"supported: {_LLAMA_FAMILY + ('gpt2',)}")


def _iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray | LazyTensor]]:
  """(name, array) for every tensor of the checkpoint files in `path`; safetensors tensors are lazy
  (read when placed), so loading holds one tensor at a time on the host."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.exists(os.path.join(path, "model.safetensors")):
    files = ["model.safetensors"]
  elif os.path.exists(os.path.join(path, "pytorch_model.bin")):
    yield from _iter_torch_bin(os.path.join(path, "pytorch_model.bin"))
    return
  else:
    raise FileNotFoundError(f"{path}: no model.safetensors, model.safetensors.index.json or "
                            "pytorch_model.bin")
  from safetensors import safe_open

  for name in files:
    file = os.path.join(path, name)
    if not os.path.exists(file):
      raise FileNotFoundError(f"{path}: shard {name} named in the index is missing")
    with safe_open(file, framework="numpy") as f:
      shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    for key, shape in shapes.items():
      yield key, LazyTensor(shape, functools.partial(_read_tensor, file, key))


def _read_tensor(file: str, key: str) -> np.ndarray:
  from safetensors import safe_open

  with safe_open(file, framework="numpy") as f:
    return f.get_tensor(key)


def _iter_torch_bin(file: str) -> Iterator[tuple[str, np.ndarray]]:
  try:
    import torch
  except ImportError as e:
    raise ImportError(f"{file} is a PyTorch pickle; reading it needs torch (or convert it to "
                      "safetensors)") from e
  state = torch.load(file, map_location="cpu", weights_only=True)
  for key, tensor in state.items():
    yield key, tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()


def _llama_path(name: str) -> str | None:
  name = name.removeprefix("model.")
  if name == "embed_tokens.weight":
    return "embed/embedding"
  if name == "norm.weight":
    return "final_norm/scale"
  if name == "lm_head.weight":
    return "lm_head/weight"
  m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
  if not m:
    return None
  layer, module, kind = m.groups()
  if module == "input_layernorm":
    return f"layers_{layer}/attn_norm/scale"
  if module == "post_attention_layernorm":
    return f"layers_{layer}/mlp_norm/scale"
  return f"layers_{layer}/{_LLAMA_LAYER[module]}/{kind}" if module in _LLAMA_LAYER else None


def _gpt2_arrays(name: str, array: np.ndarray) -> dict[str, np.ndarray] | None:
  """GPT-2 tensors; its Conv1D weights are `[in, out]` and get transposed, c_attn gets split."""
  array = np.asarray(array)  # read now: transposed and split below
  name = name.removeprefix("transformer.")
  simple = {"wte.weight": "embed/embedding", "wpe.weight": "pos_embed/embedding",
            "ln_f.weight": "final_norm/scale", "ln_f.bias": "final_norm/bias"}
  if name in simple:
    return {simple[name]: array}
  if name == "lm_head.weight":  # tied to wte in every GPT-2 checkpoint
    return {}
  m = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", name)
  if not m:
    return None
  layer, module, kind = m.groups()
  prefix = f"layers_{layer}"
  if module in _GPT2_NORMS:
    return {f"{prefix}/{_GPT2_NORMS[module]}/{'scale' if kind == 'weight' else 'bias'}": array}
  if module == "attn.c_attn":
    parts = np.split(array.T if kind == "weight" else array, 3, axis=0)
    return {f"{prefix}/attn/{p}/{kind}": a for p, a in zip(("q_proj", "k_proj", "v_proj"), parts)}
  if module in _GPT2_LAYER:
    return {f"{prefix}/{_GPT2_LAYER[module]}/{kind}": array.T if kind == "weight" else array}
  return None


def load_hf_dir(path: str, dtype: str = "float32", placement: Placement | None = None) -> tuple[ModelConfig, Params]:
  """(config, params) from a Hugging Face model directory; `placement` as in `assemble_params`."""
  config_file = os.path.join(path, "config.json")
  if not os.path.isfile(config_file):
    raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json)")
  with open(config_file) as f:
    config = config_from_hf_dict(json.load(f), dtype)
  arrays: dict[str, np.ndarray] = {}
  for name, array in _iter_tensors(path):
    if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
      continue  # non-parameter buffers some checkpoints carry
    if config.arch == "gpt2":
      mapped = _gpt2_arrays(name, array)
    else:
      target = _llama_path(name)
      mapped = None if target is None else {target: array}
      if config.tie_embeddings and target == "lm_head/weight":
        mapped = {}  # a tied checkpoint may still store the head; it equals the embedding
    if mapped is None:
      raise ValueError(f"{path}: unexpected tensor {name!r} for a {config.arch} model")
    arrays.update(mapped)
  return config, assemble_params(config, arrays, source=path, placement=placement)


# Writing: the inverse of the mapping above, for exporting specjax models as Hugging Face directories.

_LLAMA_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def config_to_hf_dict(config: ModelConfig, max_positions: int = 4096) -> dict[str, Any]:
  """A `config.json` dict that `transformers` and `config_from_hf_dict` both read back as `config`.

  Llama-family configs become "qwen2" when they have q/k/v biases, "mistral" with a sliding window,
  else "llama". `max_positions` fills llama's `max_position_embeddings` (gpt2 uses its own table).
  """
  if config.arch == "gpt2":
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_embd": config.d_model, "n_layer": config.n_layers, "n_head": config.n_heads,
            "n_inner": config.d_ff, "n_positions": config.max_positions, "activation_function": "gelu_new",
            "layer_norm_epsilon": config.norm_eps, "tie_word_embeddings": True, "dtype": config.dtype}
  model_type = "qwen2" if config.qkv_bias else "mistral" if config.sliding_window else "llama"
  hf = {"architectures": [_LLAMA_TYPES[model_type]], "model_type": model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.d_model, "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": max_positions, "tie_word_embeddings": config.tie_embeddings,
        "dtype": config.dtype}
  if model_type == "qwen2":  # specjax windows every layer: no full-attention layers below the window
    hf.update(use_sliding_window=bool(config.sliding_window), sliding_window=config.sliding_window or None,
              max_window_layers=0 if config.sliding_window else config.n_layers)
  elif model_type == "mistral":
    hf["sliding_window"] = config.sliding_window
  return hf


def params_to_hf_tensors(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """Hugging Face tensor name -> numpy array for every parameter: what `load_hf_dir` reads back."""
  flat = {"/".join(k.key for k in path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  if config.arch == "gpt2":
    return _gpt2_tensors(config, flat)
  llama_modules = {v: k for k, v in _LLAMA_LAYER.items()}
  llama_modules.update(attn_norm="input_layernorm", mlp_norm="post_attention_layernorm")
  top = {"embed/embedding": "model.embed_tokens.weight", "final_norm/scale": "model.norm.weight",
         "lm_head/weight": "lm_head.weight"}
  tensors = {}
  for path, array in flat.items():
    if path in top:
      tensors[top[path]] = array
      continue
    layer, module, kind = re.fullmatch(r"layers_(\d+)/(.+)/(\w+)", path).groups()
    tensors[f"model.layers.{layer}.{llama_modules[module]}.{'weight' if kind == 'scale' else kind}"] = array
  return tensors


def _gpt2_tensors(config: ModelConfig, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """GPT-2's names: Conv1D weights transposed back to `[in, out]`, q/k/v joined into c_attn."""
  norms = {v: k for k, v in _GPT2_NORMS.items()}
  modules = {v: k for k, v in _GPT2_LAYER.items()}
  tensors = {"transformer.wte.weight": flat["embed/embedding"], "transformer.wpe.weight": flat["pos_embed/embedding"],
             "transformer.ln_f.weight": flat["final_norm/scale"], "transformer.ln_f.bias": flat["final_norm/bias"]}
  for i in range(config.n_layers):
    prefix, h = f"layers_{i}", f"transformer.h.{i}"
    for norm, hf_norm in norms.items():
      tensors[f"{h}.{hf_norm}.weight"] = flat[f"{prefix}/{norm}/scale"]
      tensors[f"{h}.{hf_norm}.bias"] = flat[f"{prefix}/{norm}/bias"]
    qkv = [f"{prefix}/attn/{p}" for p in ("q_proj", "k_proj", "v_proj")]
    tensors[f"{h}.attn.c_attn.weight"] = np.concatenate([flat[f"{p}/weight"] for p in qkv], axis=0).T
    tensors[f"{h}.attn.c_attn.bias"] = np.concatenate([flat[f"{p}/bias"] for p in qkv])
    for module, hf_module in modules.items():
      tensors[f"{h}.{hf_module}.weight"] = flat[f"{prefix}/{module}/weight"].T
      tensors[f"{h}.{hf_module}.bias"] = flat[f"{prefix}/{module}/bias"]
  return tensors
