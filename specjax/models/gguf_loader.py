"""Loading GGUF checkpoints (llama.cpp's format) into specjax's `ModelConfig` and parameter tree.

The config comes from the `{arch}.*` metadata, the vocabulary size from `token_embd`'s shape, and the
head is tied when the file has no `output.weight`. Every tensor is dequantized to float32 with
`gguf.quants.dequantize` only when `assemble_params` asks for it and converted to the requested dtype
at once, so peak memory is the final parameters plus one float32 tensor (the 1.5B Qwen2 target is
7 GB in float32). Llama-architecture files store q/k rows permuted for llama.cpp's interleaved RoPE;
we undo it to get the Hugging Face rotate-half layout the transformer uses. Qwen2, Qwen3 (QK-norm
when the file has `attn_q_norm`) and Gemma 3 files are not permuted (llama.cpp's converter permutes for its
llama architectures only). GGUF shapes read in reverse give the Hugging Face `[out, in]` layout.

Gemma 3 (`gemma3`): llama.cpp's converter stores every RMSNorm weight as 1 + w (the scale it applies),
where transformers and specjax store w; we subtract 1 again (as transformers' GGUF loader does). The
file omits what llama.cpp hard-codes for the architecture, so we take llama.cpp's values: every sixth
layer global, the others sliding-window (`sliding_window_pattern` 6, unless the file has
`gemma3.attention.sliding_window_pattern`); the sliding layers' RoPE base 10,000 (unless
`gemma3.rope.freq_base_swa`); queries scaled by head_dim^(-1/2) (d_model / heads for the 62-layer 27B).
`rope.freq_base` and a `linear` `rope.scaling` apply to the global layers.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import gguf
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.param_tree import LazyTensor, Placement, assemble_params
from specjax.models.rope import RopeScaling
from specjax.models.transformer import Params

# GGUF architecture -> (specjax arch, q/k rows permuted by llama.cpp's converter)
_ARCHS = {
    "llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("llama", False), "qwen3": ("llama", False),
    "gemma3": ("gemma", False), "gpt2": ("gpt2", False)
}
_LLAMA_BLOCK = {
    "attn_norm.weight": "attn_norm/scale",
    "ffn_norm.weight": "mlp_norm/scale",
    "attn_q": "attn/q_proj",
    "attn_k": "attn/k_proj",
    "attn_v": "attn/v_proj",
    "attn_output": "attn/o_proj",
    "ffn_gate": "mlp/gate_proj",
    "ffn_up": "mlp/up_proj",
    "ffn_down": "mlp/down_proj",
    "attn_q_norm.weight": "attn/q_norm/scale",
    "attn_k_norm.weight": "attn/k_norm/scale",
}
_GEMMA_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_norm.weight": "post_attn_norm/scale",
    "post_ffw_norm.weight": "post_mlp_norm/scale",
}
_GEMMA3_PATTERN, _GEMMA3_LOCAL_BASE = 6, 10000.0  # llama.cpp's hard-coded Gemma 3 values
_GPT2_BLOCK = {
    "attn_norm.weight": "attn_norm/scale",
    "attn_norm.bias": "attn_norm/bias",
    "ffn_norm.weight": "mlp_norm/scale",
    "ffn_norm.bias": "mlp_norm/bias",
    "attn_output": "attn/o_proj",
    "ffn_up": "mlp/up_proj",
    "ffn_down": "mlp/down_proj",
}
_TOP = {
    "token_embd.weight": "embed/embedding", "position_embd.weight": "pos_embed/embedding",
    "output_norm.weight": "final_norm/scale", "output_norm.bias": "final_norm/bias", "output.weight": "lm_head/weight"
}


def open_gguf(path: str) -> gguf.GGUFReader:
  """A reader over the (memory-mapped) file, with clear errors for a missing or non-GGUF file."""
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such GGUF file")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise ValueError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
  try:
    return gguf.GGUFReader(path)
  except (ValueError, IndexError) as e:
    raise ValueError(f"{path}: corrupt or unsupported GGUF file: {e}") from e


def metadata(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
  """A metadata value as a Python scalar, string or list; `default` when the key is absent."""
  field = reader.get_field(key)
  return default if field is None else field.contents()


def _float32_value(x: float) -> float:
  """GGUF stores floats as float32: 1e-6 reads back as 9.99999997e-07; restore the short decimal."""
  return float(str(np.float32(x)))


def config_from_gguf(reader: gguf.GGUFReader, source: str, dtype: str = "float32") -> ModelConfig:
  """ModelConfig from a GGUF file's metadata and tensor shapes."""
  arch = metadata(reader, "general.architecture")
  if arch not in _ARCHS:
    raise ValueError(f"{source}: unsupported architecture {arch!r}; supported: {sorted(_ARCHS)}")
  shapes = {t.name: tuple(reversed(t.shape.tolist())) for t in reader.tensors}
  if "token_embd.weight" not in shapes:
    raise ValueError(f"{source}: missing tensor 'token_embd.weight'")

  def required(key: str) -> Any:
    value = metadata(reader, f"{arch}.{key}")
    if value is None:
      raise ValueError(f"{source}: missing metadata key {arch}.{key}")
    return value

  d_model, n_heads = int(required("embedding_length")), int(required("attention.head_count"))
  common = dict(vocab_size=shapes["token_embd.weight"][0], d_model=d_model, n_layers=int(required("block_count")),
                n_heads=n_heads, d_ff=int(required("feed_forward_length")), dtype=dtype, tie_embeddings="output.weight"
                not in shapes)
  if arch == "gpt2":
    return ModelConfig(arch="gpt2", n_kv_heads=n_heads, head_dim=d_model // n_heads,
                       norm_eps=_float32_value(required("attention.layer_norm_epsilon")),
                       max_positions=int(required("context_length")), **common)
  head_dim = int(metadata(reader, f"{arch}.attention.key_length", d_model // n_heads))
  rotary_dim = int(metadata(reader, f"{arch}.rope.dimension_count", head_dim))
  if rotary_dim != head_dim:
    raise ValueError(f"{source}: partial rotary embeddings ({rotary_dim} of {head_dim} dims) "
                     "are not supported")
  scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
  if scaling not in ("none", "linear") or "rope_freqs.weight" in shapes:
    raise ValueError(f"{source}: unsupported rope scaling {scaling!r} (only plain or linear RoPE)")
  common.update(
      n_kv_heads=int(metadata(reader, f"{arch}.attention.head_count_kv", n_heads)), head_dim=head_dim,
      norm_eps=_float32_value(required("attention.layer_norm_rms_epsilon")),
      rope_theta=_float32_value(metadata(reader, f"{arch}.rope.freq_base", 10000.0)), rope_scaling=RopeScaling(
          "linear", factor=float(required("rope.scaling.factor"))) if scaling == "linear" else RopeScaling(),
      sliding_window=int(metadata(reader, f"{arch}.attention.sliding_window", 0)))
  if arch == "gemma3":
    return _gemma3_config(reader, common)
  return ModelConfig(arch="llama", qkv_bias="blk.0.attn_q.bias" in shapes, qk_norm="blk.0.attn_q_norm.weight" in shapes,
                     **common)


def _gemma3_config(reader: gguf.GGUFReader, common: dict[str, Any]) -> ModelConfig:
  """Gemma 3 with what the file omits taken from llama.cpp (see the module docstring)."""
  pattern = int(metadata(reader, "gemma3.attention.sliding_window_pattern", _GEMMA3_PATTERN))
  layer_types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(common["n_layers"]))
  query_scalar = common["d_model"] // common["n_heads"] if common["n_layers"] == 62 else common["head_dim"]
  return ModelConfig(arch="gemma", qk_norm=True, layer_types=layer_types, query_pre_attn_scalar=query_scalar,
                     rope_local_theta=_float32_value(metadata(reader, "gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_BASE)),
                     final_softcap=float(metadata(reader, "gemma3.final_logit_softcapping", 0.0)), **common)


def unpermute_rows(w_DoutxDin: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute`: per head, interleaved (even, odd) rows back to two halves."""
  half = w_DoutxDin.shape[0] // num_heads // 2
  return (w_DoutxDin.reshape(num_heads, half, 2, *w_DoutxDin.shape[1:]).swapaxes(1, 2).reshape(w_DoutxDin.shape))


def _target_paths(config: ModelConfig, name: str) -> list[str] | None:
  """specjax paths a GGUF tensor maps to (three for GPT-2's fused qkv); None if it maps nowhere."""
  if name in _TOP:
    return [_TOP[name]]
  m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
  if not m:
    return None
  layer, module, kind = m.groups()
  table = {"gpt2": _GPT2_BLOCK, "gemma": _GEMMA_BLOCK, "llama": _LLAMA_BLOCK}[config.arch]
  if config.arch == "gpt2" and module == "attn_qkv":
    return [f"layers_{layer}/attn/{p}/{kind}" for p in ("q_proj", "k_proj", "v_proj")]
  if f"{module}.{kind}" in table:
    return [f"layers_{layer}/{table[f'{module}.{kind}']}"]
  return [f"layers_{layer}/{table[module]}/{kind}"] if module in table else None


def load_gguf(path: str, dtype: str = "float32", reader: gguf.GGUFReader | None = None,
              placement: Placement | None = None) -> tuple[ModelConfig, Params]:
  """(config, params) from a GGUF file; pass an open `reader` to avoid parsing the file twice, and
  `placement` as in `assemble_params` (tensors are dequantized one at a time, when placed)."""
  reader = reader or open_gguf(path)
  config = config_from_gguf(reader, path, dtype)
  permuted = _ARCHS[metadata(reader, "general.architecture")][1]
  tensors = {t.name: t for t in reader.tensors}

  @functools.lru_cache(maxsize=1)  # GPT-2's fused qkv feeds three parameters; keep only the last
  def dequantized(name: str) -> np.ndarray:
    tensor = tensors[name]
    try:
      array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
      raise ValueError(f"{path}: tensor {name} has unsupported type {tensor.tensor_type.name}") from e
    array = np.asarray(array, np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
    if permuted and re.search(r"\.attn_[qk]\.", name):
      heads = config.n_heads if ".attn_q." in name else config.n_kv_heads
      array = unpermute_rows(array, heads)
    if config.arch == "gemma" and name.endswith("norm.weight"):
      array = array - 1.0  # llama.cpp stores Gemma's norms as 1 + w
    return array

  arrays = {}
  for name, tensor in tensors.items():
    paths = _target_paths(config, name)
    if paths is None:
      raise ValueError(f"{path}: unexpected extra tensor {name!r} for a {config.arch} model")
    shape = tuple(reversed(tensor.shape.tolist()))
    for i, target in enumerate(paths):
      if len(paths) == 1:
        arrays[target] = LazyTensor(shape, functools.partial(dequantized, name))
      else:  # fused q/k/v rows, equal thirds
        third = (shape[0] // 3, *shape[1:])
        arrays[target] = LazyTensor(third,
                                    functools.partial(lambda n, i: np.split(dequantized(n), 3, axis=0)[i], name, i))
  return config, assemble_params(config, arrays, source=path, placement=placement)
