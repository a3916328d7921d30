"""The decoder-only transformer (Llama 2/3.x / Qwen2 / Qwen3 / Mistral, Gemma 2 / 3 and GPT-2; see
`config`): blocks as Flax linen modules, the model around them as pure functions.

Pure forward: `forward(config, params, tokens_BxT, cache) -> (logits_BxTxV, cache)`. Token t of row b
sits at position `cache.lengths[b] + t`; its keys/values are written there and it attends to every
position <= its own (see `attention`: `config.attention` says how; blockwise and the kernel read
only the live part of the cache). A static draft `tree` moves token t to position `lengths[b] + depth[t]`,
still written to slot `lengths[b] + t`, seeing the committed cache and its ancestors only.
`cache.lengths` is not advanced: the caller commits with `KVCache.advance`.

Precision: norms and the attention softmax run in float32; the output head multiplies the final norm's
output with float32 accumulation and returns float32 logits, on every path (prefill, decode, verify,
draft, restricted heads, distillation): logits are never rounded to bfloat16.

Parameter tree (the loaders in this package produce it). Linear weights keep the Hugging Face
`[out, in]` layout, named `weight`, and are contracted on `in`: on XLA CPU this was measurably faster
for multi-token forwards (up to 1.5x at T = 5-9 in a 1536 x 8960 matmul, 2 cores) and makes loading a
plain copy.
  embed/embedding [V, D]; pos_embed/embedding [P, D] (gpt2)
  layers_{i}/attn_norm/{scale, bias?}, layers_{i}/mlp_norm/{scale, bias?}  (before attention / MLP)
  layers_{i}/post_attn_norm/scale, layers_{i}/post_mlp_norm/scale  (gemma: on attention / MLP outputs)
  layers_{i}/attn/{q_proj, k_proj, v_proj, o_proj}/{weight [out, in], bias? [out]}
  layers_{i}/attn/{q_norm, k_norm}/scale [Dh]  (qk_norm: Qwen3, Gemma 3)
  layers_{i}/mlp/{gate_proj (llama, gemma), up_proj, down_proj}/{weight, bias? (gpt2)}
  final_norm/{scale, bias?}; lm_head/weight [V, D] (absent when tie_embeddings, unless quantized)
Any linear `weight` and the head may be a `quantized.QuantizedWeight` (codes + scales + format): the
params' own format, on which `matmul.dense` dispatches; the code below is the same for every format.
Gemma's norm scales are stored as transformers stores them: w, applied as (1 + w).
With `scan_layers` the `layers_{i}` subtrees are one stacked `layers` subtree (leading [L] axis, see
`layout`) and the blocks run as a `lax.scan`: compile time stays flat in depth, where the unrolled
Python loop grows ~0.4 s per layer. Per-layer settings (Gemma's sliding / global windows, Gemma 3's
local / global RoPE) are static tuples in the config, indexed by the scanned layer index as arrays.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.models import attention, attention_mask, matmul, rope
from specjax.models.config import BATCH_INVARIANT, ModelConfig
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.layout import to_layout
from specjax.models.quantized import QuantizedWeight

Params = Any
_init = nn.initializers.normal(stddev=0.02)
INVARIANT_WIDTH = 16  # chunks of up to this many positions reduce position by position (`per_position`)


def invariant_chunk(config: ModelConfig, T: int) -> bool:
  """Whether a chunk of T positions computes each position as a one-token step does (batch-invariant
  numerics, T <= INVARIANT_WIDTH): its reductions position by position, its attention query by query."""
  return config.numerics == BATCH_INVARIANT and T <= INVARIANT_WIDTH


def by_position(config: ModelConfig, T: int) -> bool:
  """Whether a chunk of T positions reduces position by position (`per_position`; one position already does)."""
  return T > 1 and invariant_chunk(config, T)


def per_position(config: ModelConfig, fn: Callable[[jax.Array], jax.Array], x_BxTx: jax.Array) -> jax.Array:
  """`fn(x)` for a reduction over x's last axes, run on each position's [B, 1, ...] slice in turn in the
  batch-invariant numerics mode (`ModelConfig.numerics`) where x is a chunk of 2..INVARIANT_WIDTH positions.
  XLA sums in an order that depends on how many rows it reduces; a slice reduces exactly as a one-token
  step does, so a verify pass computes bit for bit what the steps would and greedy speculative output
  equals greedy autoregressive output in bfloat16 too. Wider chunks (prefill) run whole."""
  if x_BxTx.ndim < 3 or not by_position(config, x_BxTx.shape[1]):
    return fn(x_BxTx)
  return jnp.concatenate([fn(x_BxTx[:, t:t + 1]) for t in range(x_BxTx.shape[1])], axis=1)


def _along_last(vector: jax.Array, ndim: int) -> jax.Array:
  """Reshapes a vector to broadcast against the last axis of an `ndim`-rank array."""
  return vector.reshape((1,) * (ndim - 1) + (-1,))


class Linear(nn.Module):
  """y = x W^T (+ b) with W stored `[out, in]`, through the config's matmul backend."""

  features: int
  use_bias: bool
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxDin):
    dtype = self.config.jnp_dtype
    stored = self.get_variable("params", "weight") if self.has_variable("params", "weight") else None
    # A quantized weight (`quantized`) is the params' own format; `param` would check its codes' shape.
    weight_DoutxDin = stored if isinstance(stored, QuantizedWeight) else self.param("weight", _init,
                                                                                    (self.features,
                                                                                     x_BxTxDin.shape[-1]), dtype)
    y_BxTxDout = matmul.dense(x_BxTxDin, weight_DoutxDin, self.config.matmul)
    if self.use_bias:
      bias_Dout = self.param("bias", nn.initializers.zeros, (self.features,), dtype)
      y_BxTxDout = y_BxTxDout + _along_last(bias_Dout, y_BxTxDout.ndim)
    return y_BxTxDout


class Norm(nn.Module):
  """RMSNorm (llama: w x; gemma: (1 + w) x, w initialised to 0) or LayerNorm (gpt2), computed in
  float32 like the reference implementations, over the last axis of width `features` (0: d_model)."""

  config: ModelConfig
  features: int = 0

  @nn.compact
  def __call__(self, x_xF):
    cfg = self.config
    features = self.features or cfg.d_model
    x = x_xF.astype(jnp.float32)
    init = nn.initializers.zeros if cfg.arch == "gemma" else nn.initializers.ones
    scale = _along_last(self.param("scale", init, (features,), cfg.jnp_dtype), x.ndim)
    if cfg.arch == "gpt2":
      bias = _along_last(self.param("bias", nn.initializers.zeros, (features,), cfg.jnp_dtype), x.ndim)
      x = per_position(cfg, lambda x: x - x.mean(-1, keepdims=True), x)
      x = per_position(cfg, lambda x: x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps), x)
      return (x * scale + bias).astype(cfg.jnp_dtype)
    # The whole normalisation per position, its rsqrt too: XLA's rsqrt over a chunk's T values may be
    # vectorised differently from a step's single value (seen: 3 of 24 positions off by an ulp).
    x = per_position(cfg, lambda x: x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps), x)
    if cfg.arch == "gemma":  # Gemma scales in float32, then rounds; Llama rounds, then scales
      return (x * (1.0 + scale.astype(jnp.float32))).astype(cfg.jnp_dtype)
    return scale * x.astype(cfg.jnp_dtype)


def per_layer(values: tuple, layer):
  """`values[layer]` for an int layer, or a traced layer index (`scan_layers`); the static value itself
  when every layer has the same one (then nothing is traced)."""
  if len(set(values)) == 1:
    return values[0]
  return values[layer] if isinstance(layer, int) else jnp.asarray(values)[layer]


def rotary_tables(config: ModelConfig, positions_BxT: jax.Array) -> tuple[jax.Array, jax.Array] | None:
  """cos and sin [R, B, T, Dh / 2] of every RoPE of the model (`config.ropes()`: R = 2 for Gemma 3's
  global and local bases, else 1), computed once per forward and picked per layer; None for gpt2."""
  if config.arch == "gpt2":
    return None
  tables = [rope.cos_sin(scaling, theta, config.head_dim, positions_BxT) for theta, scaling in config.ropes()]
  return jnp.stack([cos for cos, _ in tables]), jnp.stack([sin for _, sin in tables])


def cache_attention(cfg: ModelConfig, q_BxTxHxDh: jax.Array, k_BxTxGxDh: jax.Array, v_BxTxGxDh: jax.Array,
                    cache: KVCache, layer, tree=None) -> tuple[jax.Array, KVCache]:
  """`Attention`'s default core: writes the chunk's keys/values into the static cache at each row's
  offset (a tree level after the levels above it) and attends over the cache's `layer` (see
  `attention`). Returns [B, T, H, Dh] and the written cache."""
  B, T, H, Dh = q_BxTxHxDh.shape
  G = k_BxTxGxDh.shape[2]
  cache = (cache.write(layer, k_BxTxGxDh, v_BxTxGxDh) if tree is None else cache.write(
      layer, k_BxTxGxDh, v_BxTxGxDh, tree.first))
  q_BxTxGxHgxDh = q_BxTxHxDh.reshape(B, T, G, H // G, Dh)
  window = per_layer(cfg.layer_windows(), layer)
  mask = attention_mask.Mask(cache.lengths, window, tree)
  # A chain in the batch-invariant mode, one-token steps included: query t computes what a one-token step
  # at length lengths + t computes (`per_position`), all T queries in one loop over the key blocks.
  per_query = tree is None and invariant_chunk(cfg, T)
  out_BxTxGxHgxDh, k, v = attention.attend(q_BxTxGxHgxDh, cache.k, cache.v, layer, mask, cfg, per_query)
  return out_BxTxGxHgxDh.reshape(B, T, H, Dh), cache.replace(k=k, v=v)


class Attention(nn.Module):
  """Grouped-query attention of one layer: the q/k/v projections (biases, QK-norm, RoPE as the family
  has them), an attention core, the output projection."""

  config: ModelConfig
  # (config, q [B, T, H, Dh], k, v [B, T, G, Dh], state, layer, tree) -> (out [B, T, H, Dh], state):
  # which keys each query sees. The static KV cache by default; EAGLE's training-time test plugs in its own.
  core: Callable = cache_attention

  @nn.compact
  def __call__(self, x_BxTxD, rotary, cache: KVCache, layer, tree=None):
    cfg = self.config
    B, T, _ = x_BxTxD.shape
    H, G, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    bias = cfg.qkv_bias or cfg.arch == "gpt2"
    q = Linear(H * Dh, bias, cfg, name="q_proj")(x_BxTxD).reshape(B, T, H, Dh)
    k = Linear(G * Dh, bias, cfg, name="k_proj")(x_BxTxD).reshape(B, T, G, Dh)
    v = Linear(G * Dh, bias, cfg, name="v_proj")(x_BxTxD).reshape(B, T, G, Dh)
    if cfg.qk_norm:
      q = Norm(cfg, Dh, name="q_norm")(q)
      k = Norm(cfg, Dh, name="k_norm")(k)
    if rotary is not None:
      index = per_layer(cfg.layer_ropes(), layer)
      cos_BxTxFq, sin_BxTxFq = rotary[0][index], rotary[1][index]
      q, k = rope.rotate(q, cos_BxTxFq, sin_BxTxFq), rope.rotate(k, cos_BxTxFq, sin_BxTxFq)
    out_BxTxHxDh, cache = self.core(cfg, q, k, v, cache, layer, tree)
    out = Linear(cfg.d_model, cfg.arch == "gpt2", cfg, name="o_proj")(out_BxTxHxDh.reshape(B, T, H * Dh))
    return out, cache


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.config
    if cfg.arch == "gpt2":
      hidden = Linear(cfg.d_ff, True, cfg, name="up_proj")(x_BxTxD)
      hidden = jax.nn.gelu(hidden, approximate=True)  # GPT-2's "gelu_new"
      return Linear(cfg.d_model, True, cfg, name="down_proj")(hidden)
    gate = Linear(cfg.d_ff, False, cfg, name="gate_proj")(x_BxTxD)
    up = Linear(cfg.d_ff, False, cfg, name="up_proj")(x_BxTxD)
    # Gemma's "gelu_pytorch_tanh" (GeGLU), Llama's SiLU (SwiGLU)
    activation = jax.nn.gelu(gate, approximate=True) if cfg.arch == "gemma" else jax.nn.silu(gate)
    return Linear(cfg.d_model, False, cfg, name="down_proj")(activation * up)


class Block(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD, rotary, cache: KVCache, layer, tree=None):
    """`layer` (an int, or a traced index under `scan_layers`) selects this block's cache slice, window
    and RoPE; `tree` (static) masks a tree chunk (see `attention`). Gemma also normalises each sublayer's output
    before adding it to the residual stream."""
    cfg = self.config
    post_norm = (lambda name, h: Norm(cfg, name=name)(h)) if cfg.arch == "gemma" else (lambda name, h: h)
    attn_out, cache = Attention(cfg, name="attn")(Norm(cfg, name="attn_norm")(x_BxTxD), rotary, cache, layer, tree)
    x_BxTxD = x_BxTxD + post_norm("post_attn_norm", attn_out)
    mlp_out = MLP(cfg, name="mlp")(Norm(cfg, name="mlp_norm")(x_BxTxD))
    return x_BxTxD + post_norm("post_mlp_norm", mlp_out), cache


def take_rows(table_VxD: jax.Array, ids_x: jax.Array, backend: str = "xla") -> jax.Array:
  """The rows `ids_x` of a table [V, D] ([..., D]). XLA:CPU widens a bfloat16 operand of a gather to
  float32 and hoists that out of the loops, so every call of a program copied whole embeddings (151936 x
  1536 bfloat16: ~0.2 s a call) to read a few rows: with the CPU kernel (`backend`, the model's matmul
  backend) a bfloat16 table's rows are copied by it (`matmul.take_rows`); elsewhere a 16-bit float table
  is gathered as its bits (XLA:CPU then copies the bits once a call, half the float32 copy; free on
  GPU/TPU)."""
  if backend == "cpu_kernel" and table_VxD.dtype == jnp.bfloat16:
    return matmul.take_rows(table_VxD, ids_x)
  if jnp.dtype(table_VxD.dtype).itemsize != 2 or not jnp.issubdtype(table_VxD.dtype, jnp.floating):
    return jnp.take(table_VxD, ids_x, axis=0)
  bits_VxD = jax.lax.bitcast_convert_type(table_VxD, jnp.uint16)
  return jax.lax.bitcast_convert_type(jnp.take(bits_VxD, ids_x, axis=0), table_VxD.dtype)


def _embed(config: ModelConfig, params: Params, tokens_BxT: jax.Array, positions_BxT: jax.Array) -> jax.Array:
  x_BxTxD = take_rows(params["embed"]["embedding"], tokens_BxT, config.matmul)
  if config.arch == "gpt2":
    x_BxTxD = x_BxTxD + take_rows(params["pos_embed"]["embedding"], positions_BxT, config.matmul)
  if config.arch == "gemma":  # sqrt(D) rounded to float32, then to the model dtype, as in transformers
    x_BxTxD = x_BxTxD * jnp.asarray(config.d_model**0.5, jnp.float32).astype(x_BxTxD.dtype)
  return x_BxTxD


def _blocks(config: ModelConfig, params: Params, x_BxTxD: jax.Array, rotary, cache: KVCache, layers: tuple[int, ...],
            tree=None) -> tuple[jax.Array, KVCache]:
  """Runs the blocks `layers` in order: a Python loop over `layers_{i}`, or a `lax.scan` over the
  stacked `layers` (indexing weights, cache, windows and RoPEs by the scanned layer index). With
  `config.remat` each block is a `jax.checkpoint`: differentiating keeps only its input, and recomputes
  the rest of its activations in the backward (training memory ~ one block's activations plus each
  block's input)."""
  block = Block(config)
  if not config.scan_layers:
    for i in layers:
      apply = lambda layer_params, x_BxTxD, cache, i=i: block.apply({"params": layer_params}, x_BxTxD, rotary, cache, i,
                                                                    tree)
      x_BxTxD, cache = (jax.checkpoint(apply) if config.remat else apply)(params[f"layers_{i}"], x_BxTxD, cache)
    return x_BxTxD, cache

  def step(carry, i):
    x_BxTxD, cache = carry
    layer_params = jax.tree.map(lambda stacked: stacked[i], params["layers"])
    return block.apply({"params": layer_params}, x_BxTxD, rotary, cache, i, tree), None

  step = jax.checkpoint(step) if config.remat else step

  (x_BxTxD, cache), _ = jax.lax.scan(step, (x_BxTxD, cache), jnp.asarray(layers, jnp.int32))
  return x_BxTxD, cache


def forward_hidden(config: ModelConfig, params: Params, tokens_BxT: jax.Array, cache: KVCache,
                   layers: tuple[int, ...] | None = None, tree=None) -> tuple[jax.Array, KVCache]:
  """Final-norm hidden states [B, T, D] and the written (not advanced) cache; through the
  blocks `layers` only (static; self-speculation drafts with a subset of the target's layers, reading
  and writing the target's own cache at those layers) when given. With a static `tree` (T = its
  nodes; see `speculative.tree`) token t sits at position `lengths + depth[t]`, is written to slot
  `lengths + t` and attends to the committed cache and its ancestors; a `TreeLevel` writes its nodes
  after the `first` ones, already written by earlier passes; None is a chain."""
  hidden_BxTxD, _, cache = forward_features(config, params, tokens_BxT, cache, (), layers, tree)
  return hidden_BxTxD, cache


def forward_features(config: ModelConfig, params: Params, tokens_BxT: jax.Array, cache: KVCache,
                     feature_layers: tuple[int, ...], layers: tuple[int, ...] | None = None,
                     tree=None) -> tuple[jax.Array, jax.Array, KVCache]:
  """`forward_hidden`, also returning features [B, T, F] for a drafter that reads the target's hidden
  states (EAGLE): the residual streams after the blocks `feature_layers` (static, ascending, among the
  blocks run), concatenated (F = len(feature_layers) * D); the final-norm hidden states themselves
  (F = D, nothing extra computed) when `feature_layers` is ()."""
  T = tokens_BxT.shape[1]
  layers = tuple(range(config.n_layers)) if layers is None else layers
  if list(feature_layers) != sorted(set(feature_layers)) or not set(feature_layers) <= set(layers):
    raise ValueError(f"feature layers {feature_layers} must be ascending, distinct and among the blocks run "
                     f"({layers[0]}..{layers[-1]} of a {config.n_layers}-layer model)")
  positions_BxT = attention_mask.query_positions(cache.lengths, T, tree)
  x_BxTxD = _embed(config, params, tokens_BxT, positions_BxT)
  rotary = rotary_tables(config, positions_BxT)
  streams = []  # the blocks run in segments ending at each feature layer: one segment when there are none
  start = 0
  for stop in [layers.index(i) + 1 for i in feature_layers]:
    x_BxTxD, cache = _blocks(config, params, x_BxTxD, rotary, cache, layers[start:stop], tree)
    streams.append(x_BxTxD)
    start = stop
  x_BxTxD, cache = _blocks(config, params, x_BxTxD, rotary, cache, layers[start:], tree)
  hidden_BxTxD = Norm(config).apply({"params": params["final_norm"]}, x_BxTxD)
  return hidden_BxTxD, jnp.concatenate(streams, axis=-1) if streams else hidden_BxTxD, cache


def output_head(config: ModelConfig, params: Params) -> jax.Array | QuantizedWeight:
  """The output head's weight [V, D]: `lm_head`, or the token embedding when tied (unless the params
  carry a quantized copy of it as `lm_head`: `quantized.quantize_params`)."""
  if config.tie_embeddings and "lm_head" not in params:
    return params["embed"]["embedding"]
  return params["lm_head"]["weight"]


def hidden_to_logits(config: ModelConfig, params: Params, hidden_xD: jax.Array) -> jax.Array:
  """Float32 logits [..., V] for hidden states [..., D]: the head's matmul in the model dtype with
  float32 accumulation (a float32 copy of a [V, D] head per call would cost more than the matmul),
  soft-capped by `config.final_softcap` (Gemma 2)."""
  weight_VxD = output_head(config, params)
  logits_xV = matmul.dense(hidden_xD.astype(weight_VxD.dtype), weight_VxD, config.matmul, jnp.float32)
  return attention_mask.soft_cap(logits_xV, config.final_softcap)


def forward(config: ModelConfig, params: Params, tokens_BxT: jax.Array, cache: KVCache,
            tree=None) -> tuple[jax.Array, KVCache]:
  """Logits [B, T, V] (float32) of every position and the written (not advanced) cache; `tree` as in
  `forward_hidden`."""
  hidden_BxTxD, cache = forward_hidden(config, params, tokens_BxT, cache, tree=tree)
  return hidden_to_logits(config, params, hidden_BxTxD), cache


def init_params(config: ModelConfig, key: jax.Array) -> Params:
  """Random parameters (normal, std 0.02; norms 1 (gemma: 0, i.e. a scale of 1), biases 0) in the tree the loaders
  produce, in the layout of `config.scan_layers`; for tests and fresh drafts."""
  embed_key, pos_key, head_key, *layer_keys = jax.random.split(key, config.n_layers + 3)
  table = lambda key, rows: _init(key, (rows, config.d_model), config.jnp_dtype)
  x_1x1xD = jnp.zeros((1, 1, config.d_model), config.jnp_dtype)
  cache = init_cache(config, batch_size=1, max_len=1)
  rotary = rotary_tables(config, jnp.zeros((1, 1), jnp.int32))
  params = {"embed": {"embedding": table(embed_key, config.vocab_size)}}
  if config.arch == "gpt2":
    params["pos_embed"] = {"embedding": table(pos_key, config.max_positions)}
  for i, layer_key in enumerate(layer_keys):
    params[f"layers_{i}"] = Block(config).init(layer_key, x_1x1xD, rotary, cache, i)["params"]
  params["final_norm"] = Norm(config).init(head_key, x_1x1xD)["params"]
  if not config.tie_embeddings:
    params["lm_head"] = {"weight": table(head_key, config.vocab_size)}
  return to_layout(config, params)


def prefill(config: ModelConfig, params: Params, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Feeds right-padded prompts of different lengths, `config.prefill_chunk` positions per pass.

  Returns the float32 logits [B, V] at each row's last prompt token and the cache advanced by each
  row's own prompt length (the padding's keys lie beyond the length: masked, later overwritten).
  Chunk c feeds positions [c C, (c + 1) C) of every row and advances each row by its real tokens in
  it, so peak memory is that of one C-token pass (scores ~ C x live keys), not of a P-token one; the
  result equals a one-shot prefill up to float rounding. The chunks run as a `lax.scan` (P is padded to
  a multiple of C inside; a row's padding writes beyond its length or is dropped past the cache).
  """
  logits_BxV, _, cache = _prefill(config, params, prompts_BxP, prompt_lengths_B, cache, None)
  return logits_BxV, cache


def hidden_after(hidden_BxTxD: jax.Array, count_B: jax.Array) -> jax.Array:
  """[B, D]: each row's hidden state at its `count_B`-th position of the pass (its last real id; the first
  position's for a row with none, which callers mask or ignore)."""
  last_B = jnp.clip(count_B - 1, 0, hidden_BxTxD.shape[1] - 1)
  return jnp.take_along_axis(hidden_BxTxD, last_B[:, None, None], axis=1)[:, 0]


def feed_rows(config: ModelConfig, params: Params, ids_BxT: jax.Array, lengths_B: jax.Array, cache: KVCache,
              chunk: int) -> tuple[jax.Array, KVCache]:
  """Feeds right-padded rows of ids `chunk` positions per pass, only while some row has ids left (a
  buffer mostly padding, e.g. a lag as long as the whole history or a prompt spelled by another
  tokenizer, costs the passes its longest row needs). Returns the hidden state after each row's last id
  [B, D] (zeros for an empty row) and the cache advanced by each row's length."""
  B, T = ids_BxT.shape
  chunk = min(chunk, T)
  ids_BxT = jnp.pad(ids_BxT, ((0, 0), (0, -T % chunk)))

  def feed(carry):
    start, cache, last_BxD = carry
    hidden_BxCxD, cache = forward_hidden(config, params, jax.lax.dynamic_slice_in_dim(ids_BxT, start, chunk, axis=1),
                                         cache)
    real_B = jnp.clip(lengths_B - start, 0, chunk)  # this chunk's ids per row
    return (start + chunk, cache.advance(real_B),
            jnp.where((real_B > 0)[:, None], hidden_after(hidden_BxCxD, real_B), last_BxD))

  _, cache, last_BxD = jax.lax.while_loop(lambda carry: carry[0] < jnp.max(lengths_B), feed,
                                          (jnp.int32(0), cache, jnp.zeros((B, config.d_model), config.jnp_dtype)))
  return last_BxD, cache


def prefill_features(config: ModelConfig, params: Params, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
                     cache: KVCache, feature_layers: tuple[int, ...]) -> tuple[jax.Array, jax.Array, KVCache]:
  """`prefill`, also returning the features [B, P, F] of every prompt position (`forward_features`;
  positions past a row's length hold the padding's)."""
  return _prefill(config, params, prompts_BxP, prompt_lengths_B, cache, feature_layers)


def _prefill(config: ModelConfig, params: Params, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array, cache: KVCache,
             feature_layers: tuple[int, ...] | None):
  """`prefill`, with the features of `feature_layers` (None: none kept) as a middle result."""
  B, P = prompts_BxP.shape
  chunk = min(config.prefill_chunk, P)
  num_chunks = -(-P // chunk)
  chunks_PcxBxT = jnp.pad(prompts_BxP, ((0, 0), (0, num_chunks * chunk - P))).reshape(B, num_chunks,
                                                                                      chunk).transpose(1, 0, 2)

  def feed(carry, chunk_index_and_tokens):
    cache, last_BxD = carry
    index, tokens_BxT = chunk_index_and_tokens
    hidden_BxTxD, features_BxTxF, cache = forward_features(config, params, tokens_BxT, cache, feature_layers or ())
    real_B = jnp.clip(prompt_lengths_B - index * chunk, 0, chunk)  # this chunk's prompt tokens per row
    # The last chunk holding prompt tokens of a row holds its last one.
    return ((cache.advance(real_B), jnp.where((real_B > 0)[:, None], hidden_after(hidden_BxTxD, real_B),
                                              last_BxD)), None if feature_layers is None else features_BxTxF)

  last_BxD = jnp.zeros((B, config.d_model), config.jnp_dtype)
  (cache, last_BxD), features_PcxBxTxF = jax.lax.scan(feed, (cache, last_BxD),
                                                      (jnp.arange(num_chunks, dtype=jnp.int32), chunks_PcxBxT))
  features_BxPxF = None if feature_layers is None else features_PcxBxTxF.transpose(1, 0, 2, 3).reshape(
      B, num_chunks * chunk, -1)[:, :P]
  return hidden_to_logits(config, params, last_BxD), features_BxPxF, cache
