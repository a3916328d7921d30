"""Loading Hugging Face checkpoint directories: `config.json` + safetensors (single or sharded) or
`pytorch_model.bin`, mapped onto specjax's parameter tree without transposes (same `[out, in]` layout).
The inverse mapping (`config_to_hf_dict`, `params_to_hf_tensors`) writes specjax models back out.

Model types: llama (2 and 3.x), qwen2, qwen3, mistral, gemma2, gemma3_text (and a multimodal gemma3
checkpoint's language model), gpt2. RoPE from the classic `rope_scaling` / `rope_theta` keys or
transformers v5's `rope_parameters` (nested by layer type for Gemma 3): default, linear, dynamic, yarn,
llama3; any other type is refused by name.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from typing import Any, Iterator

import jax
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.param_tree import LazyTensor, Placement, assemble_params
from specjax.models.rope import ROPE_TYPES, RopeScaling
from specjax.models.transformer import Params

_LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")
_GEMMA_FAMILY = ("gemma2", "gemma3_text", "gemma3")
_LLAMA_LAYER = {
    "self_attn.q_proj": "attn/q_proj",
    "self_attn.k_proj": "attn/k_proj",
    "self_attn.v_proj": "attn/v_proj",
    "self_attn.o_proj": "attn/o_proj",
    "self_attn.q_norm": "attn/q_norm",
    "self_attn.k_norm": "attn/k_norm",
    "mlp.gate_proj": "mlp/gate_proj",
    "mlp.up_proj": "mlp/up_proj",
    "mlp.down_proj": "mlp/down_proj",
}
_NORMS = {  # Hugging Face layer norm -> specjax norm, per block style
    "llama": {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"},
    "gemma": {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
              "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"},
}
_GPT2_LAYER = {"attn.c_proj": "attn/o_proj", "mlp.c_fc": "mlp/up_proj", "mlp.c_proj": "mlp/down_proj"}
_GPT2_NORMS = {"ln_1": "attn_norm", "ln_2": "mlp_norm"}
_GEMMA_ACTIVATION = "gelu_pytorch_tanh"


def _yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
  """transformers' default YaRN attention factor: 0.1 ln(factor) + 1, or the ratio of the two mscales."""
  def get_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if mscale and mscale_all_dim:
    return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
  return get_mscale(factor)


def rope_scaling_from_hf(params: dict[str, Any], hf: dict[str, Any]) -> RopeScaling:
  """A `RopeScaling` from one (flat) RoPE parameter dict, as transformers' `modeling_rope_utils` reads it:
  the pre-training context defaults to `max_position_embeddings` (dynamic always uses that), a missing
  yarn factor to max / original positions, yarn's attention factor to its mscale formula."""
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"unsupported RoPE type {rope_type!r} in config.json; supported: {ROPE_TYPES}")
  if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
  if rope_type == "default":
    return RopeScaling()
  if rope_type == "linear":
    return RopeScaling("linear", factor=float(params["factor"]))
  max_positions = hf.get("max_position_embeddings")
  original = (hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or
              max_positions)
  if not original:
    raise ValueError(f"RoPE type {rope_type!r} needs max_position_embeddings or original_max_position_embeddings")
  if rope_type == "dynamic":
    return RopeScaling("dynamic", factor=float(params["factor"]), original_max_positions=int(max_positions or original))
  if rope_type == "llama3":
    return RopeScaling("llama3", factor=float(params["factor"]), original_max_positions=int(original),
                       low_freq_factor=float(params["low_freq_factor"]),
                       high_freq_factor=float(params["high_freq_factor"]))
  factor = float(params.get("factor") or max_positions / original)
  attention_factor = params.get("attention_factor")
  if attention_factor is None:
    attention_factor = _yarn_attention_factor(factor, params.get("mscale"), params.get("mscale_all_dim"))
  return RopeScaling("yarn", factor=factor, original_max_positions=int(original),
                     beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                     attention_factor=float(attention_factor), truncate=bool(params.get("truncate", True)))


def _flat_rope(hf: dict[str, Any], default_theta: float) -> tuple[float, RopeScaling]:
  """(base, scaling) from the classic `rope_scaling` + `rope_theta` keys or transformers v5's
  `rope_parameters` (the classic key wins, as in transformers)."""
  params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  return float(params.get("rope_theta", hf.get("rope_theta", default_theta))), rope_scaling_from_hf(params, hf)


def _gemma3_ropes(hf: dict[str, Any]) -> tuple[float, RopeScaling, float]:
  """Gemma 3's global (base, scaling) and local base, from v5's `rope_parameters` nested by layer type
  or the classic `rope_theta` / `rope_scaling` (global layers only) / `rope_local_base_freq` keys."""
  params = hf.get("rope_parameters") or {}
  global_params = {**(params.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
  local_params = params.get("sliding_attention") or {}
  if local_params.get("rope_type", local_params.get("type", "default")) != "default":
    raise ValueError(f"unsupported RoPE scaling {local_params} on Gemma 3's sliding layers (only default)")
  global_theta = float(global_params.get("rope_theta", hf.get("rope_theta", 1e6)))  # Gemma 3's defaults
  local_theta = float(local_params.get("rope_theta", hf.get("rope_local_base_freq", 1e4)))
  return global_theta, rope_scaling_from_hf(global_params, hf), local_theta


def _uniform(window: int, layer_types: tuple[str, ...]) -> tuple[int, tuple[str, ...]]:
  """(window, layer_types) with a pattern shared by every layer folded into the window alone."""
  if len(set(layer_types)) > 1:
    return window, layer_types
  return (window if layer_types[:1] != ("full_attention",) else 0), ()


def _llama_config(hf: dict[str, Any], dtype: str) -> ModelConfig:
  model_type, n_heads, n_layers = hf["model_type"], hf["num_attention_heads"], hf["num_hidden_layers"]
  window = hf.get("sliding_window") or 0
  layer_types = ()
  if model_type in ("qwen2", "qwen3"):  # windowed from layer max_window_layers on, if at all
    window = window if hf.get("use_sliding_window", False) else 0
    first = hf.get("max_window_layers", n_layers)
    layer_types = tuple(
        hf.get("layer_types") or
        ("sliding_attention" if window and i >= first else "full_attention" for i in range(n_layers)))
    window, layer_types = _uniform(window, layer_types)
  theta, scaling = _flat_rope(hf, 10000.0)
  return ModelConfig(
      arch="llama",
      vocab_size=hf["vocab_size"],
      d_model=hf["hidden_size"],
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
      d_ff=hf["intermediate_size"],
      norm_eps=hf.get("rms_norm_eps", 1e-6),
      rope_theta=theta,
      rope_scaling=scaling,
      qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
      qk_norm=model_type == "qwen3",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),  # transformers' default
      sliding_window=window,
      layer_types=layer_types,
      dtype=dtype)


def _gemma_config(hf: dict[str, Any], dtype: str) -> ModelConfig:
  """Gemma 2 / Gemma 3 text configs, with transformers' defaults for absent keys. Gemma 3's
  `attn_logit_softcapping` is ignored, as transformers' Gemma 3 attention ignores it."""
  gemma3 = hf["model_type"] == "gemma3_text"
  activation = hf.get("hidden_activation") or hf.get("hidden_act") or _GEMMA_ACTIVATION
  if activation != _GEMMA_ACTIVATION:
    raise ValueError(f"unsupported Gemma activation {activation!r} (only {_GEMMA_ACTIVATION})")
  if hf.get("use_bidirectional_attention"):
    raise ValueError("Gemma with use_bidirectional_attention is an encoder, not a causal language model")
  n_layers, n_heads = hf["num_hidden_layers"], hf.get("num_attention_heads", 8)
  pattern = hf.get("sliding_window_pattern", 6) if gemma3 else 2  # every pattern-th layer is global
  layer_types = tuple(
      hf.get("layer_types") or
      ("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)))
  if gemma3:
    theta, scaling, local_theta = _gemma3_ropes(hf)
  else:
    (theta, scaling), local_theta = _flat_rope(hf, 10000.0), 0.0
  return ModelConfig(arch="gemma", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n_layers,
                     n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
                     head_dim=hf.get("head_dim") or 256, d_ff=hf["intermediate_size"],
                     norm_eps=hf.get("rms_norm_eps",
                                     1e-6), rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
                     qk_norm=gemma3, tie_embeddings=bool(hf.get("tie_word_embeddings",
                                                                True)), sliding_window=hf.get("sliding_window", 4096) or
                     0, layer_types=layer_types, query_pre_attn_scalar=int(hf.get("query_pre_attn_scalar", 256)),
                     attn_softcap=0.0 if gemma3 else float(hf.get("attn_logit_softcapping", 50.0) or 0.0),
                     final_softcap=float(hf.get("final_logit_softcapping", None if gemma3 else 30.0) or
                                         0.0), dtype=dtype)


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
  """The language model's config of a multimodal Gemma 3 checkpoint (its vision tower is not loaded)."""
  return {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **hf["text_config"], "model_type": "gemma3_text"}


def config_from_hf_dict(hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
  """ModelConfig from a `config.json` dict; raises on architectures or features we do not implement."""
  model_type = hf.get("model_type")
  if model_type == "gemma3":
    return _gemma_config(_text_config(hf), dtype)
  if model_type in _LLAMA_FAMILY:
    return _llama_config(hf, dtype)
  if model_type in _GEMMA_FAMILY:
    return _gemma_config(hf, dtype)
  if model_type == "gpt2":
    if hf.get("activation_function", "gelu_new") != "gelu_new":
      raise ValueError(f"unsupported gpt2 activation {hf['activation_function']!r} (only gelu_new)")
    d_model, n_heads = hf["n_embd"], hf["n_head"]
    return ModelConfig(arch="gpt2", vocab_size=hf["vocab_size"], d_model=d_model, n_layers=hf["n_layer"],
                       n_heads=n_heads, n_kv_heads=n_heads, head_dim=d_model // n_heads, d_ff=hf.get("n_inner") or
                       4 * d_model, norm_eps=hf.get("layer_norm_epsilon", 1e-5), max_positions=hf["n_positions"],
                       tie_embeddings=True, dtype=dtype)
  raise ValueError(f"unsupported architecture model_type={model_type!r}; "
                   f"supported: {_LLAMA_FAMILY + _GEMMA_FAMILY + ('gpt2',)}")


def iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray | LazyTensor]]:
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


def _llama_path(config: ModelConfig, name: str) -> str | None:
  """The specjax path of a Llama-style (llama, qwen, mistral, gemma) tensor name; None if it maps nowhere."""
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
  norms = _NORMS[config.arch]
  if module in norms:
    return f"layers_{layer}/{norms[module]}/scale"
  if module in _LLAMA_LAYER:
    return f"layers_{layer}/{_LLAMA_LAYER[module]}/{'scale' if module.endswith('norm') else kind}"
  return None


def _language_model_name(name: str) -> str | None:
  """A multimodal Gemma 3 tensor name as the text model names it; None for the vision tower's."""
  if name.startswith(
      ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")):
    return None
  for prefix, text_prefix in (("model.language_model.", "model."), ("language_model.model.", "model."),
                              ("language_model.lm_head.", "lm_head.")):
    if name.startswith(prefix):
      return text_prefix + name.removeprefix(prefix)
  return name


def _gpt2_arrays(name: str, array: np.ndarray) -> dict[str, np.ndarray] | None:
  """GPT-2 tensors; its Conv1D weights are `[in, out]` and get transposed, c_attn gets split."""
  array = np.asarray(array)  # read now: transposed and split below
  name = name.removeprefix("transformer.")
  simple = {
      "wte.weight": "embed/embedding", "wpe.weight": "pos_embed/embedding", "ln_f.weight": "final_norm/scale",
      "ln_f.bias": "final_norm/bias"
  }
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


def _hf_dict(path: str) -> dict[str, Any]:
  """The `config.json` of a Hugging Face model directory; a directory without one fails naming it."""
  config_file = os.path.join(path, "config.json")
  if not os.path.isfile(config_file):
    raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json)")
  with open(config_file) as f:
    return json.load(f)


def hf_config(path: str, dtype: str = "float32") -> ModelConfig:
  """The ModelConfig of a Hugging Face model directory, without reading its weights."""
  return config_from_hf_dict(_hf_dict(path), dtype)


def load_hf_dir(path: str, dtype: str = "float32", placement: Placement | None = None) -> tuple[ModelConfig, Params]:
  """(config, params) from a Hugging Face model directory (of a multimodal Gemma 3: its language model);
  `placement` as in `assemble_params`."""
  hf = _hf_dict(path)
  config = config_from_hf_dict(hf, dtype)
  arrays: dict[str, np.ndarray] = {}
  for name, array in iter_tensors(path):
    if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
      continue  # non-parameter buffers some checkpoints carry
    if hf.get("model_type") == "gemma3":
      name = _language_model_name(name)
      if name is None:
        continue
    if config.arch == "gpt2":
      mapped = _gpt2_arrays(name, array)
    else:
      target = _llama_path(config, name)
      mapped = None if target is None else {target: array}
      if config.tie_embeddings and target == "lm_head/weight":
        mapped = {}  # a tied checkpoint may still store the head; it equals the embedding
    if mapped is None:
      raise ValueError(f"{path}: unexpected tensor {name!r} for a {config.arch} model")
    arrays.update(mapped)
  return config, assemble_params(config, arrays, source=path, placement=placement)


# Writing: the inverse of the mapping above, for exporting specjax models as Hugging Face directories.

_CLASSES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"
}


def rope_to_hf(theta: float, scaling: RopeScaling) -> dict[str, Any]:
  """A v5 `rope_parameters` dict that `rope_scaling_from_hf` and transformers read as (theta, scaling)."""
  params = {"rope_type": scaling.type, "rope_theta": theta}
  if scaling.type != "default":
    params["factor"] = scaling.factor
  if scaling.type == "llama3":
    params.update(original_max_position_embeddings=scaling.original_max_positions,
                  low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor)
  if scaling.type == "yarn":
    params.update(original_max_position_embeddings=scaling.original_max_positions, beta_fast=scaling.beta_fast,
                  beta_slow=scaling.beta_slow, attention_factor=scaling.attention_factor, truncate=scaling.truncate)
  return params


def _llama_model_type(config: ModelConfig) -> str:
  """qwen2 with q/k/v biases, qwen3 with QK-norm, mistral with a window on every layer, else llama;
  raises for settings none of them expresses."""
  if config.qkv_bias and config.qk_norm:
    raise ValueError("no Hugging Face model type has both q/k/v biases and QK-norm")
  if config.rope_local_theta or config.attn_softcap or config.final_softcap or config.query_pre_attn_scalar:
    raise ValueError("local RoPE bases, soft-capping and query_pre_attn_scalar are Gemma settings: no "
                     "Llama-style Hugging Face model type expresses them")
  model_type = ("qwen2"
                if config.qkv_bias else "qwen3" if config.qk_norm else "mistral" if config.sliding_window else "llama")
  if config.layer_types and model_type not in ("qwen2", "qwen3"):
    raise ValueError(f"per-layer windows {config.layer_types} need q/k/v biases (qwen2) or QK-norm (qwen3) "
                     "to be exported: llama and mistral window all layers or none")
  return model_type


def _gemma_model_type(config: ModelConfig) -> str:
  """gemma3_text with QK-norm, else gemma2; raises for settings transformers would not run as written."""
  if config.qk_norm and config.attn_softcap:
    raise ValueError("transformers' Gemma 3 ignores attention soft-capping: this config cannot be exported")
  if not config.qk_norm and config.rope_local_theta:
    raise ValueError("Gemma 2 has one RoPE base: a local base needs Gemma 3 (QK-norm)")
  return "gemma3_text" if config.qk_norm else "gemma2"


def config_to_hf_dict(config: ModelConfig, max_positions: int = 4096) -> dict[str, Any]:
  """A `config.json` dict that `transformers` and `config_from_hf_dict` both read back as `config`.

  Llama-style configs become "qwen2" with q/k/v biases, "qwen3" with QK-norm, "mistral" with a sliding
  window, else "llama"; gemma configs "gemma3_text" with QK-norm, else "gemma2". `max_positions` fills
  `max_position_embeddings` (gpt2 uses its own table), except under dynamic RoPE, whose frequencies
  depend on it: there it is the scaling's original context.
  """
  if config.arch == "gpt2":
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
        "n_embd": config.d_model, "n_layer": config.n_layers, "n_head": config.n_heads, "n_inner": config.d_ff,
        "n_positions": config.max_positions, "activation_function": "gelu_new", "layer_norm_epsilon": config.norm_eps,
        "tie_word_embeddings": True, "dtype": config.dtype
    }
  model_type = _gemma_model_type(config) if config.arch == "gemma" else _llama_model_type(config)
  rope_parameters = rope_to_hf(config.rope_theta, config.rope_scaling)
  if config.rope_scaling.type == "dynamic":
    max_positions = config.rope_scaling.original_max_positions
  hf = {
      "architectures": [_CLASSES[model_type]], "model_type": model_type, "vocab_size": config.vocab_size,
      "hidden_size": config.d_model, "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
      "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim,
      "rms_norm_eps": config.norm_eps, "rope_parameters": rope_parameters, "max_position_embeddings": max_positions,
      "tie_word_embeddings": config.tie_embeddings, "dtype": config.dtype
  }
  if config.arch == "gemma":
    local_rope = rope_to_hf(config.rope_local_theta, RopeScaling()) if config.rope_local_theta else rope_parameters
    hf.update(
        hidden_activation=_GEMMA_ACTIVATION, sliding_window=config.sliding_window,
        layer_types=list(config.layer_types) or
        ["sliding_attention" if w else "full_attention" for w in config.layer_windows()],
        query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
        attn_logit_softcapping=config.attn_softcap or None, final_logit_softcapping=config.final_softcap or None)
    if model_type == "gemma3_text":
      hf["rope_parameters"] = {"full_attention": rope_parameters, "sliding_attention": local_rope}
    return hf
  hf.update(hidden_act="silu", rope_theta=config.rope_theta)
  if model_type in ("qwen2", "qwen3"):  # layer_types: per layer; else every layer windowed or none
    windowed = [w > 0 for w in config.layer_windows()]
    hf.update(use_sliding_window=any(windowed), sliding_window=config.sliding_window or None,
              max_window_layers=windowed.index(True) if any(windowed) else config.n_layers,
              layer_types=["sliding_attention" if w else "full_attention" for w in windowed])
  elif model_type == "mistral":
    hf["sliding_window"] = config.sliding_window
  return hf


def params_to_hf_tensors(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """Hugging Face tensor name -> numpy array for every parameter: what `load_hf_dir` reads back."""
  flat = {
      "/".join(k.key for k in path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
  }
  if config.arch == "gpt2":
    return _gpt2_tensors(config, flat)
  modules = {v: k for k, v in _LLAMA_LAYER.items()}
  modules.update({v: k for k, v in _NORMS[config.arch].items()})
  top = {
      "embed/embedding": "model.embed_tokens.weight", "final_norm/scale": "model.norm.weight",
      "lm_head/weight": "lm_head.weight"
  }
  tensors = {}
  for path, array in flat.items():
    if path in top:
      tensors[top[path]] = array
      continue
    layer, module, kind = re.fullmatch(r"layers_(\d+)/(.+)/(\w+)", path).groups()
    tensors[f"model.layers.{layer}.{modules[module]}.{'weight' if kind == 'scale' else kind}"] = array
  return tensors


def _gpt2_tensors(config: ModelConfig, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """GPT-2's names: Conv1D weights transposed back to `[in, out]`, q/k/v joined into c_attn."""
  norms = {v: k for k, v in _GPT2_NORMS.items()}
  modules = {v: k for k, v in _GPT2_LAYER.items()}
  tensors = {
      "transformer.wte.weight": flat["embed/embedding"], "transformer.wpe.weight": flat["pos_embed/embedding"],
      "transformer.ln_f.weight": flat["final_norm/scale"], "transformer.ln_f.bias": flat["final_norm/bias"]
  }
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
