"""GGUF files written from tiny `transformers` models the way llama.cpp's converter writes them (q/k rows
permuted for llama, GPT-2's Conv1D weights transposed, Gemma's norms stored as 1 + w)."""

from typing import Callable

import gguf
import numpy as np

ARCH = {
    "llama": "llama", "qwen2": "qwen2", "qwen2_tied": "qwen2", "gpt2": "gpt2", "qwen3": "qwen3",
    "gemma3_llama_cpp": "gemma3"
}
_LLAMA_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_GEMMA_NAMES = {
    **_LLAMA_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GPT2_NAMES = {
    "ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"
}


def llama_cpp_permute(w_DoutxDin: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (halves -> interleaved pairs per head)."""
  return (w_DoutxDin.reshape(num_heads, 2, w_DoutxDin.shape[0] // num_heads // 2,
                             *w_DoutxDin.shape[1:]).swapaxes(1, 2).reshape(w_DoutxDin.shape))


def gguf_tensors(family: str, model) -> dict[str, np.ndarray]:
  """GGUF tensor name -> float32 array in the file's layout, as llama.cpp's converter writes them."""
  cfg = model.config
  gemma = family.startswith("gemma")
  out = {}
  for name, tensor in model.state_dict().items():
    array = tensor.numpy().astype(np.float32)
    if family == "gpt2":
      name = name.removeprefix("transformer.")
      if name == "lm_head.weight" or name.endswith(".attn.bias") or name.endswith("masked_bias"):
        continue
      top = {
          "wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight", "ln_f.weight": "output_norm.weight",
          "ln_f.bias": "output_norm.bias"
      }
      if name in top:
        out[top[name]] = array
        continue
      _, layer, *module, kind = name.split(".")
      module = ".".join(module)
      transpose = kind == "weight" and module not in ("ln_1", "ln_2")  # Conv1D [in, out] -> [out, in]
      out[f"blk.{layer}.{_GPT2_NAMES[module]}.{kind}"] = array.T if transpose else array
      continue
    name = name.removeprefix("model.")
    if gemma and name.endswith("norm.weight"):
      array = array + 1.0  # llama.cpp's Gemma converter stores the applied scale 1 + w
    if name == "embed_tokens.weight":
      out["token_embd.weight"] = array
    elif name == "norm.weight":
      out["output_norm.weight"] = array
    elif name == "lm_head.weight":
      if not cfg.tie_word_embeddings:
        out["output.weight"] = array
    else:
      _, layer, *module, kind = name.split(".")
      module = ".".join(module)
      if family == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
        heads = cfg.num_attention_heads if module == "self_attn.q_proj" else cfg.num_key_value_heads
        array = llama_cpp_permute(array, heads)
      out[f"blk.{layer}.{(_GEMMA_NAMES if gemma else _LLAMA_NAMES)[module]}.{kind}"] = array
  if family == "gpt2":  # llama.cpp writes GPT-2's tied head as its own tensor
    out["output.weight"] = out["token_embd.weight"]
  return out


def write_gguf(path: str, family: str, model, qtype=gguf.GGMLQuantizationType.F32, arch: str | None = None,
               tensors: dict[str, np.ndarray] | None = None,
               add_metadata: Callable[[gguf.GGUFWriter], None] = lambda writer: None) -> None:
  """Writes `model` as a GGUF file: 2-D weights in `qtype`, norms and biases in F32 (as llama.cpp);
  `add_metadata` may add more keys (a tokenizer)."""
  cfg = model.config
  arch = arch or ARCH[family]
  writer = gguf.GGUFWriter(path, arch)
  writer.add_name(f"tiny-{family}")
  writer.add_block_count(cfg.num_hidden_layers)
  writer.add_context_length(cfg.max_position_embeddings)
  writer.add_embedding_length(cfg.hidden_size)
  writer.add_feed_forward_length(getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size)
  writer.add_head_count(cfg.num_attention_heads)
  writer.add_vocab_size(cfg.vocab_size)
  if family == "gpt2":
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
  else:
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: the global layers'
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  if family.startswith(("gemma", "qwen3")):  # explicit head_dim, as llama.cpp's converters write it
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
  if family.startswith("gemma"):  # what llama.cpp's Gemma 3 converter writes beyond the llama keys
    writer.add_sliding_window(cfg.sliding_window)
    if rope["rope_type"] == "linear":
      writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
      writer.add_rope_scaling_factor(rope["factor"])
  add_metadata(writer)
  for name, array in (tensors if tensors is not None else gguf_tensors(family, model)).items():
    if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
      writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    else:
      writer.add_tensor(name, array)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
