"""Saving and loading EAGLE heads (`eagle`): specjax's own layout, and published EAGLE-3 heads as released.

specjax's layout, a directory of two files:
  eagle_head.json          {"format": "specjax-eagle-head", "block": the block's ModelConfig fields,
                            "feature_layers": [...]}
  eagle_head.safetensors   the head's parameter tree (float32 or bfloat16), keys its paths joined by "/"
                           (fc/weight, layer/attn/q_proj/weight, ..., final_norm/scale), plus vocab/tokens [Vd]
                           int32 when the head scores a restricted vocabulary: those rows of the target's
                           output head, gathered when the head loads (heads written before this held them
                           too, as vocab/weight [Vd, D], which still loads)

EAGLE-3's released layout (SafeAILab/EAGLE, `eagle/model/cnets.py`; e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B):
config.json (a one-layer LlamaConfig with `draft_vocab_size`) and model.safetensors or pytorch_model.bin:
  fc.weight [D, 3D]                                fc/weight
  midlayer.input_layernorm.weight                  layer/input_norm/scale   (on the token embedding)
  midlayer.hidden_norm.weight                      layer/hidden_norm/scale  (on the fused feature)
  midlayer.self_attn.{q,k,v,o}_proj.weight         layer/attn/{q,k,v,o}_proj/weight  (q/k/v read 2D)
  midlayer.post_attention_layernorm.weight         layer/mlp_norm/scale
  midlayer.mlp.{gate,up,down}_proj.weight          layer/mlp/{gate,up,down}_proj/weight
  norm.weight                                      final_norm/scale
  lm_head.weight [Vd, D], d2t [Vd]                 the restricted vocabulary: draft id i is target id i + d2t[i]
  t2d [V], embed_tokens.weight                     unused (t2d is the mask of those ids; the embedding is the target's)
Its features are the residual streams entering the target's blocks 2, L // 2 and L - 3, i.e. after blocks
1, L // 2 - 1 and L - 4 (`eagle3_layers`); its block's RoPE, heads and MLP come from its config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.hf import config_from_hf_dict, iter_tensors
from specjax.models.transformer import Params
from specjax.speculative.drafters.draft_head import DraftHead, restrict_head
from specjax.speculative.drafters.eagle_head import EagleConfig, check_head, eagle3_layers

CONFIG_FILE = "eagle_head.json"
WEIGHTS_FILE = "eagle_head.safetensors"
_FORMAT = "specjax-eagle-head"

_EAGLE3_NAMES = {  # EAGLE-3 tensor name -> specjax path (the vocabulary maps are handled apart)
    "fc.weight": "fc/weight",
    "midlayer.input_layernorm.weight": "layer/input_norm/scale",
    "midlayer.hidden_norm.weight": "layer/hidden_norm/scale",
    "midlayer.post_attention_layernorm.weight": "layer/mlp_norm/scale",
    "norm.weight": "final_norm/scale",
    **{f"midlayer.self_attn.{p}_proj.weight": f"layer/attn/{p}_proj/weight" for p in "qkvo"},
    **{f"midlayer.mlp.{p}_proj.weight": f"layer/mlp/{p}_proj/weight" for p in ("gate", "up", "down")},
}
_EAGLE3_UNUSED = ("t2d", "embed_tokens.weight")


def _flatten(tree: Params, dtype=np.float32, prefix: str = "") -> dict[str, np.ndarray]:
  """{"a/b/c": array in `dtype`} for a nested parameter tree."""
  if not isinstance(tree, Mapping):
    return {prefix: np.asarray(tree, np.float32).astype(dtype)}
  flat = {}
  for name, subtree in tree.items():
    flat.update(_flatten(subtree, dtype, f"{prefix}/{name}" if prefix else name))
  return flat


def _unflatten(flat: dict[str, np.ndarray], dtype) -> Params:
  """The nested tree of `_flatten`'s keys, in `dtype`."""
  tree: dict = {}
  for path, array in flat.items():
    *parents, leaf = path.split("/")
    node = tree
    for name in parents:
      node = node.setdefault(name, {})
    node[leaf] = jnp.asarray(array, dtype)
  return tree


SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def save_head(directory: str, config: EagleConfig, params: Params, vocab: DraftHead | None = None,
              dtype: str = "float32") -> None:
  """Writes a head in specjax's layout, its weights in `dtype` ("float32" or "bfloat16": half the bytes,
  what a head committed to a repository uses); a restricted vocabulary as its token ids alone."""
  from safetensors.numpy import save_file

  if dtype not in SAVE_DTYPES:
    raise ValueError(f"a head is saved in one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
  os.makedirs(directory, exist_ok=True)
  tensors = _flatten(params, SAVE_DTYPES[dtype])
  if vocab is not None:
    tensors["vocab/tokens"] = np.asarray(vocab.tokens_Vd, np.int32)
  save_file(tensors, os.path.join(directory, WEIGHTS_FILE))
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(
        {"format": _FORMAT, "block": dataclasses.asdict(config.block), "feature_layers": list(config.feature_layers)},
        f, indent=1)


def load_head(directory: str, target_config: ModelConfig,
              target_params: Params) -> tuple[EagleConfig, Params, DraftHead | None]:
  """A head for the target (`target_config`, `target_params`: its output head serves a restricted
  vocabulary) from `directory`, in specjax's layout or EAGLE-3's (see the module docstring), in the
  target's dtype; raises ValueError when it does not fit the target."""
  if os.path.exists(os.path.join(directory, CONFIG_FILE)):
    config, flat = _read_specjax(directory)
  elif os.path.exists(os.path.join(directory, "config.json")):
    config, flat = _read_eagle3(directory, target_config)
  else:
    raise FileNotFoundError(f"{directory}: neither an EAGLE head in specjax's layout ({CONFIG_FILE}) nor "
                            "an EAGLE-3 head (config.json)")
  config = dataclasses.replace(
      config, block=config.block.replace(vocab_size=target_config.vocab_size, dtype=target_config.dtype,
                                         matmul=target_config.matmul))
  tokens_Vd, weight_VdxD = flat.pop("vocab/tokens", None), flat.pop("vocab/weight", None)
  vocab = None
  if tokens_Vd is not None and weight_VdxD is None:
    if tokens_Vd.size and (tokens_Vd.min() < 0 or tokens_Vd.max() >= target_config.vocab_size):
      raise ValueError(f"{directory}: the head's vocabulary holds ids up to {tokens_Vd.max()}, the target has "
                       f"{target_config.vocab_size}: this head was trained for another target")
    vocab = restrict_head(target_config, target_params, tokens_Vd)
  elif tokens_Vd is not None:
    vocab = DraftHead(tokens_Vd=jnp.asarray(tokens_Vd,
                                            jnp.int32), weight_VdxD=jnp.asarray(weight_VdxD, target_config.jnp_dtype),
                      vocab_size=target_config.vocab_size, softcap=target_config.final_softcap,
                      matmul=target_config.matmul)
  params = _unflatten(flat, target_config.jnp_dtype)
  check_head(config, params, target_config, vocab)
  return config, params, vocab


def _read_specjax(directory: str) -> tuple[EagleConfig, dict[str, np.ndarray]]:
  from safetensors.numpy import load_file

  with open(os.path.join(directory, CONFIG_FILE)) as f:
    meta = json.load(f)
  if meta.get("format") != _FORMAT:
    raise ValueError(f"{directory}/{CONFIG_FILE}: format {meta.get('format')!r}, expected {_FORMAT!r}")
  config = EagleConfig(block=ModelConfig.from_dict(meta["block"]), feature_layers=tuple(meta["feature_layers"]))
  return config, load_file(os.path.join(directory, WEIGHTS_FILE))


def _read_eagle3(directory: str, target_config: ModelConfig) -> tuple[EagleConfig, dict[str, np.ndarray]]:
  """EAGLE-3's tensors renamed to specjax's paths; its vocabulary map turned into vocab/tokens (sorted,
  with the head's rows in that order)."""
  with open(os.path.join(directory, "config.json")) as f:
    hf = json.load(f)
  if hf.get("num_hidden_layers", 1) != 1 and "draft_vocab_size" not in hf:  # EAGLE-3 heads hold one layer
    raise ValueError(f"{directory}: a model directory ({hf.get('model_type', 'a model')} with "
                     f"{hf['num_hidden_layers']} layers), not a draft head: give a head trained by specjax.distill "
                     f"({CONFIG_FILE}) or a published EAGLE-3 head")
  if hf.get("target_hidden_size", hf["hidden_size"]) != target_config.d_model:
    raise ValueError(f"{directory}: an EAGLE-3 head for a target of width "
                     f"{hf.get('target_hidden_size', hf['hidden_size'])}, this target's d_model is "
                     f"{target_config.d_model}")
  block = config_from_hf_dict({"model_type": "llama", **hf, "num_hidden_layers": 1})
  flat, d2t_Vd, head_VdxD = {}, None, None
  for name, array in iter_tensors(directory):
    if name == "d2t":
      d2t_Vd = np.asarray(array, np.int64)
    elif name == "lm_head.weight":
      head_VdxD = np.asarray(array, np.float32)
    elif name in _EAGLE3_NAMES:
      flat[_EAGLE3_NAMES[name]] = np.asarray(array, np.float32)
    elif name not in _EAGLE3_UNUSED:
      raise ValueError(f"{directory}: unexpected tensor {name!r} for an EAGLE-3 head")
  missing = sorted(name for name, path in _EAGLE3_NAMES.items() if path not in flat)
  missing += [] if head_VdxD is not None else ["lm_head.weight"]
  if missing:
    raise ValueError(f"{directory}: EAGLE-3 head lacks {missing}")
  tokens_Vd = np.arange(len(head_VdxD)) + (0 if d2t_Vd is None else d2t_Vd)
  order = np.argsort(tokens_Vd, kind="stable")
  flat["vocab/tokens"], flat["vocab/weight"] = tokens_Vd[order].astype(np.int32), head_VdxD[order]
  return EagleConfig(block=block, feature_layers=eagle3_layers(target_config.n_layers)), flat
