"""An EAGLE draft head: one decoder block that drafts from the target's own hidden states (Li et al.,
EAGLE 2024; EAGLE-3 2025), shared by drafting (`eagle`), loading (`eagle_io`) and training
(`specjax.distill`).

The head. At position t it reads the pair (target feature f_t, next token x_{t+1}) and predicts x_{t+2}:
  fused_t = fc(f_t)                          EAGLE-3: f_t = [h_low ; h_mid ; h_high] [3D] -> [D]
                                             EAGLE-1: f_t = the final-norm hidden state [D], no fc
  x = [input_norm(embed(x_{t+1})) ; hidden_norm(fused_t)]        [2D]: the block's q/k/v read 2D
  h = fused_t + attn(x);  out_t = h + mlp(mlp_norm(h))           [D]: the head's own next feature
  logits = output head(final_norm(out_t))
We keep EAGLE-3's block as it is (q/k/v projections of input width 2D, the residual stream starting at the
fused feature) rather than projecting [2D] -> [D] first: published heads load as a plain copy
(`eagle_io`). The token embedding and the output head are the target's (shared, never trained); the head
may instead score a subset of the vocabulary through its own rows (`DraftHead`, EAGLE-3's `draft_vocab`).
The feature layers name blocks of the target: f_t holds the residual stream *after* each of them
(`forward_features`); EAGLE-3's (low, middle, high) choice for L layers is (1, L // 2 - 1, L - 4)
(`eagle3_layers`: the streams entering its blocks 2, L // 2 and L - 3).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.models import attention_mask, matmul
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.transformer import MLP, Attention, Norm, Params, cache_attention, rotary_tables, take_rows
from specjax.speculative.drafters.draft_head import DraftHead, draft_logits


@dataclasses.dataclass(frozen=True)
class EagleConfig:
  """The static shape of a head (hashable: a static argument under `jax.jit`)."""

  block: ModelConfig  # its decoder block: 1 layer of the target's width, heads and MLP (q/k/v read 2D)
  feature_layers: tuple[int, ...] = ()  # target blocks whose outputs are fused (EAGLE-3: 3); () = EAGLE-1

  @property
  def feature_width(self) -> int:
    """F: the width of the target features the head reads (D when it reads the final-norm hidden state)."""
    return self.block.d_model * max(len(self.feature_layers), 1)


def eagle3_layers(n_layers: int) -> tuple[int, ...]:
  """EAGLE-3's low, middle and high feature layers of an `n_layers`-layer target (blocks after which
  the residual stream is read); at least 4 layers."""
  if n_layers < 4:
    raise ValueError(f"EAGLE-3 features need a target of at least 4 layers, got {n_layers}")
  return tuple(sorted({1, n_layers // 2 - 1, n_layers - 4}))


def head_config(target_config: ModelConfig, feature_layers: tuple[int, ...] = ()) -> EagleConfig:
  """A head for `target_config`: one block like the target's (width, heads, MLP, norms, RoPE)."""
  block = target_config.with_depth(1).replace(scan_layers=False, remat=False)
  return EagleConfig(block=block, feature_layers=tuple(feature_layers))


class EagleLayer(nn.Module):
  """The head's block: attention over [embedding ; feature] (2D wide), residual stream from the feature.
  Drafting and training run this one block; they differ only in its attention core (see
  `transformer.Attention`): the head's KV cache when drafting, the training-time test's chains when
  training (`distill.eagle_steps`)."""

  config: ModelConfig
  core: Callable = cache_attention  # the attention core and its state (`cache`): the head's KV cache by default

  @nn.compact
  def __call__(self, embed_BxTxD, fused_BxTxD, rotary, cache: KVCache, tree=None):
    cfg = self.config
    x_BxTx2D = jnp.concatenate([Norm(cfg, name="input_norm")(embed_BxTxD),
                                Norm(cfg, name="hidden_norm")(fused_BxTxD)], axis=-1)
    attn_out, cache = Attention(cfg, self.core, name="attn")(x_BxTx2D, rotary, cache, 0, tree)
    h_BxTxD = fused_BxTxD + attn_out
    return h_BxTxD + MLP(cfg, name="mlp")(Norm(cfg, name="mlp_norm")(h_BxTxD)), cache


MASK_PARAM = "mask"  # a DFlash head's extra parameter: `mask/embedding` [D], the input of its block's mask slots
MASK_ID = -1  # the token id a block's mask slots carry (`head_forward` feeds them `mask/embedding`)


def init_head_params(config: EagleConfig, key: jax.Array, mask: bool = False) -> Params:
  """Random head parameters: `fc/weight` [D, F] (EAGLE-3 only), `layer/...`, `final_norm/scale`, and
  with `mask` a DFlash head's `mask/embedding` [D]."""
  block = config.block
  fc_key, layer_key, norm_key = jax.random.split(key, 3)
  x_1x1xD = jnp.zeros((1, 1, block.d_model), block.jnp_dtype)
  rotary = rotary_tables(block, jnp.zeros((1, 1), jnp.int32))
  params = {
      "layer": EagleLayer(block).init(layer_key, x_1x1xD, x_1x1xD, rotary, init_cache(block, 1, 1))["params"],
      "final_norm": Norm(block).init(norm_key, x_1x1xD)["params"]
  }
  if config.feature_layers:
    params["fc"] = {"weight": 0.02 * jax.random.normal(fc_key, (block.d_model, config.feature_width), block.jnp_dtype)}
  if mask:
    params[MASK_PARAM] = {
        "embedding": 0.02 * jax.random.normal(jax.random.fold_in(norm_key, 1), (block.d_model,), block.jnp_dtype)
    }
  return params


def fuse(config: EagleConfig, params: Params, features_xF: jax.Array) -> jax.Array:
  """Target features [..., F] -> the head's input features [..., D] (EAGLE-3's `fc`; EAGLE-1: as is)."""
  if not config.feature_layers:
    return features_xF.astype(config.block.jnp_dtype)
  weight_DxF = params["fc"]["weight"]
  return matmul.dense(features_xF.astype(weight_DxF.dtype), weight_DxF, config.block.matmul)


class Core(NamedTuple):
  """An attention core other than the head's KV cache (training's: `distill.eagle_steps.ttt_unroll`) and
  the positions [B, T] of the pairs it attends."""

  attend: Callable
  positions_BxT: jax.Array


def head_forward(config: EagleConfig, params: Params, embedding_VxD: jax.Array, tokens_BxT: jax.Array,
                 fused_BxTxD: jax.Array, cache: KVCache, tree=None,
                 core: Core | None = None) -> tuple[jax.Array, KVCache]:
  """The head's outputs [B, T, D] (pre-norm: its own next features) for the pairs (fused feature,
  token) at positions `cache.lengths[b] + t` (a tree chunk: `+ depth[t]`, see `attention`), and its
  written (not advanced) cache. Training runs the same block with its own attention `core` (then `cache`
  is that core's state) at the core's positions. A head with a learned mask (`MASK_PARAM`, a DFlash
  head's: `drafters.dflash`) reads it where a token is MASK_ID, instead of an embedding."""
  if core is None:
    core = Core(cache_attention, attention_mask.query_positions(cache.lengths, tokens_BxT.shape[1], tree))
  masked_BxT = tokens_BxT == MASK_ID if MASK_PARAM in params else None
  if masked_BxT is not None:
    tokens_BxT = jnp.where(masked_BxT, 0, tokens_BxT)  # any id: its embedding is replaced
  embed_BxTxD = take_rows(embedding_VxD, tokens_BxT, config.block.matmul).astype(config.block.jnp_dtype)
  if masked_BxT is not None:
    mask_D = params[MASK_PARAM]["embedding"].astype(config.block.jnp_dtype)
    embed_BxTxD = jnp.where(masked_BxT[:, :, None], mask_D[None, None, :], embed_BxTxD)
  return EagleLayer(config.block, core.attend).apply({"params": params["layer"]}, embed_BxTxD, fused_BxTxD,
                                                     rotary_tables(config.block, core.positions_BxT), cache, tree)


def head_logits(config: EagleConfig, params: Params, target_config: ModelConfig, target_params: Params,
                vocab: DraftHead | None, out_xD: jax.Array) -> jax.Array:
  """Float32 logits [..., V] of head outputs: its final norm, then the target's output head (or the
  restricted `vocab` head)."""
  return draft_logits(target_config, target_params, vocab, _final_norm(config, params, out_xD))


def head_scores(config: EagleConfig, params: Params, target_config: ModelConfig, target_params: Params,
                vocab: DraftHead | None, out_xD: jax.Array) -> jax.Array:
  """Float32 logits over the head's own vocabulary: [..., V] through the target's output head, or
  [..., Vd] of a restricted `vocab`'s tokens (no -inf columns: what training computes over)."""
  if vocab is None:
    return head_logits(config, params, target_config, target_params, None, out_xD)
  return vocab.scores(_final_norm(config, params, out_xD))


def _final_norm(config: EagleConfig, params: Params, out_xD: jax.Array) -> jax.Array:
  return Norm(config.block).apply({"params": params["final_norm"]}, out_xD)


def check_head(config: EagleConfig, params: Params, target_config: ModelConfig, vocab: DraftHead | None = None) -> None:
  """Raises ValueError unless the head fits the target: widths, vocabulary and feature layers."""
  if config.block.d_model != target_config.d_model:
    raise ValueError(f"the EAGLE head is {config.block.d_model} wide, the target's d_model is "
                     f"{target_config.d_model}: this head was trained for another target")
  bad = [i for i in config.feature_layers if not 0 <= i < target_config.n_layers]
  if bad:
    raise ValueError(f"the EAGLE head reads features after target layers {bad}, but the target has "
                     f"{target_config.n_layers} layers (0..{target_config.n_layers - 1})")
  if list(config.feature_layers) != sorted(set(config.feature_layers)):
    raise ValueError(f"EAGLE feature layers must be ascending and distinct, got {config.feature_layers}")
  if config.feature_layers and params["fc"]["weight"].shape != (config.block.d_model, config.feature_width):
    raise ValueError(f"the head's fc weight is {params['fc']['weight'].shape}, expected "
                     f"{(config.block.d_model, config.feature_width)} for feature layers {config.feature_layers}")
  if vocab is not None and (vocab.vocab_size != target_config.vocab_size or
                            vocab.weight_VdxD.shape[1] != target_config.d_model):
    raise ValueError(f"the head's restricted vocabulary spans {vocab.vocab_size} ids of width "
                     f"{vocab.weight_VdxD.shape[1]}; the target has {target_config.vocab_size} of width "
                     f"{target_config.d_model}")
