"""`ModelConfig`: the frozen, hashable description of one decoder-only transformer.

One family, three block styles (`arch`):
- "llama": Llama 2/3.x / Qwen2 / Qwen3 / Mistral: RoPE (any `RopeScaling` variant), RMSNorm, gated SiLU
  MLP, grouped-query attention, optional q/k/v bias, optional per-head QK-norm (Qwen3), tied or
  untied head, optional sliding window.
- "gemma": Gemma 2 / Gemma 3 text models: embeddings scaled by sqrt(d_model), (1 + w) RMSNorms before and
  after attention and MLP, gated GELU (tanh) MLP, attention scaled by `query_pre_attn_scalar`^(-1/2),
  sliding-window and global layers (`layer_types`), with Gemma 2's attention-logit and final-logit
  soft-capping or Gemma 3's QK-norm and its local RoPE base for the sliding layers; tied head.
- "gpt2": learned positions, LayerNorm, GELU MLP, biases everywhere, tied head.
The config is a static argument of every jitted function: changing it recompiles.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.models.rope import RopeScaling

ARCHITECTURES = ("llama", "gemma", "gpt2")
LAYER_TYPES = ("sliding_attention", "full_attention")
_DTYPES = ("float32", "bfloat16", "float16")
# How attention runs (`attention.attend`); `kernel_interpret` is the kernel in Pallas interpret mode (CPU).
ATTENTION_IMPLEMENTATIONS = ("dense", "blockwise", "kernel", "kernel_interpret")
MATMUL_BACKENDS = ("xla", "cpu_kernel")  # how weight matmuls run (`matmul`); "cpu_kernel": float32/bfloat16
# What one pass's outputs may depend on (`ModelConfig.numerics`; `specjax.models.execution` says more):
# "batch_invariant": not on how many rows or positions the pass holds (bit for bit); "fast": up to rounding.
BATCH_INVARIANT, FAST = "batch_invariant", "fast"
NUMERICS = (BATCH_INVARIANT, FAST)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of one model; every field is static (hashable) under `jax.jit`."""

  arch: str  # "llama" (also Qwen2 / Qwen3 / Mistral), "gemma" (Gemma 2 / 3) or "gpt2"
  vocab_size: int  # V: rows of the embedding and of the output head
  d_model: int  # D: width of the residual stream
  n_layers: int  # number of transformer blocks
  n_heads: int  # H: query heads
  n_kv_heads: int  # G: key/value heads (H % G == 0; G < H is grouped-query attention)
  head_dim: int  # Dh: width of one head
  d_ff: int  # Dff: hidden width of the MLP
  norm_eps: float = 1e-6  # epsilon of RMSNorm / LayerNorm
  rope_theta: float = 10000.0  # RoPE base (llama, gemma; Gemma 3: of the global layers)
  rope_scaling: RopeScaling = RopeScaling()  # RoPE variant (Gemma 3: of the global layers only)
  rope_local_theta: float = 0.0  # Gemma 3: plain-RoPE base of the sliding layers; 0 = as the others
  max_positions: int = 0  # rows of the learned position table (gpt2 only)
  qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2: True)
  qk_norm: bool = False  # RMSNorm over head_dim on each q and k head before RoPE (Qwen3, Gemma 3)
  tie_embeddings: bool = False  # output head = token embedding (GPT-2, Gemma, small Qwen models)
  sliding_window: int = 0  # local attention window W: a query sees the W positions up to its own; 0 = none
  layer_types: tuple[str, ...] = ()  # per layer, one of LAYER_TYPES (Gemma); () = every layer windowed
  #                                    iff sliding_window (Mistral)
  query_pre_attn_scalar: int = 0  # attention scores scaled by its ^(-1/2) (Gemma); 0 = head_dim
  attn_softcap: float = 0.0  # scores -> c tanh(scores / c) before the mask (Gemma 2); 0 = none
  final_softcap: float = 0.0  # logits -> c tanh(logits / c) (Gemma 2); 0 = none
  dtype: str = "float32"  # compute and parameter dtype ("bfloat16" on GPU/TPU)
  # How to run it (static, no effect on the numbers beyond float rounding):
  scan_layers: bool = False  # params stacked under `layers` with a leading [L] axis, run by `lax.scan`
  attention: str = "blockwise"  # one of ATTENTION_IMPLEMENTATIONS
  attention_block: int = 256  # keys per block of the blockwise attention; 0 = dense over S_max
  prefill_chunk: int = 512  # prompt tokens fed per prefill pass (peak memory ~ chunk x live keys)
  # A pass that may run at several compiled widths (verify, catch-up) runs the narrowest that fits (a
  # data-dependent branch: on GPU a host read of its predicate) or, False, always the widest.
  narrow_passes: bool = True
  remat: bool = False  # `jax.checkpoint` around each block: a backward pass recomputes the block's activations
  matmul: str = "xla"  # one of MATMUL_BACKENDS: every weight matmul's backend (see `matmul`)

  def __post_init__(self):
    if self.arch not in ARCHITECTURES:
      raise ValueError(f"unsupported architecture {self.arch!r}; expected one of {ARCHITECTURES}")
    if self.dtype not in _DTYPES:
      raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {_DTYPES}")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
      if getattr(self, name) < 1:
        raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {self.attention!r}")
    if self.matmul not in MATMUL_BACKENDS:
      raise ValueError(f"matmul must be one of {MATMUL_BACKENDS}, got {self.matmul!r}")
    if self.matmul == "cpu_kernel" and self.dtype == "float16":
      raise ValueError("matmul='cpu_kernel' multiplies float32 or bfloat16 weights, not float16")
    if self.attention_block < 0 or self.prefill_chunk < 1:
      raise ValueError(f"attention_block must be >= 0 and prefill_chunk >= 1, got {self.attention_block} "
                       f"and {self.prefill_chunk}")
    if self.arch == "gpt2" and self.max_positions < 1:
      raise ValueError("gpt2 needs max_positions >= 1 (rows of its learned position table)")
    if self.layer_types and (len(self.layer_types) != self.n_layers or not set(self.layer_types) <= set(LAYER_TYPES)):
      raise ValueError(f"layer_types must hold one of {LAYER_TYPES} per layer ({self.n_layers}), got "
                       f"{self.layer_types}")
    if self.rope_local_theta and not self.layer_types:
      raise ValueError("rope_local_theta applies to sliding layers: it needs layer_types")

  @classmethod
  def from_dict(cls, fields: dict) -> "ModelConfig":
    """The inverse of `dataclasses.asdict` (after a JSON round trip: lists back to tuples)."""
    fields = dict(fields)
    fields["rope_scaling"] = RopeScaling(**fields.get("rope_scaling", {}))
    fields["layer_types"] = tuple(fields.get("layer_types", ()))
    return cls(**fields)

  def with_depth(self, n_layers: int) -> "ModelConfig":
    """This config with `n_layers` blocks whose layer types continue this config's pattern (the first
    `n_layers` of it, repeated when longer): a truncated draft keeps its kept layers' pattern."""
    layer_types = tuple(self.layer_types[i % self.n_layers] for i in range(n_layers)) if self.layer_types else ()
    return self.replace(n_layers=n_layers, layer_types=layer_types)

  def layer_windows(self) -> tuple[int, ...]:
    """The attention window of every layer (0 = full causal attention)."""
    if not self.layer_types:
      return (self.sliding_window,) * self.n_layers
    return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in self.layer_types)

  def layer_ropes(self) -> tuple[int, ...]:
    """Per layer, which of `ropes()` rotates its queries and keys."""
    if not self.rope_local_theta:
      return (0,) * self.n_layers
    return tuple(int(t == "sliding_attention") for t in self.layer_types)

  def ropes(self) -> tuple[tuple[float, RopeScaling], ...]:
    """The distinct (base, scaling) RoPEs of the model: the global one, then Gemma 3's local one."""
    global_rope = (self.rope_theta, self.rope_scaling)
    return (global_rope, (self.rope_local_theta, RopeScaling())) if self.rope_local_theta else (global_rope,)

  def attention_scale(self) -> float:
    """The factor on q.k: query_pre_attn_scalar^(-1/2) (Gemma), else head_dim^(-1/2)."""
    return (self.query_pre_attn_scalar or self.head_dim)**-0.5

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def numerics(self) -> str:
    """The numerics mode (one of NUMERICS): batch-invariant where the CPU matmul kernel runs the weights,
    the one path here whose matmuls are (the model code then reduces short chunks position by position,
    `transformer.per_position`, in float32 caches); fast elsewhere. A GPU or TPU path would need
    batch-invariant matmul and attention kernels (a fixed reduction split), which are not built."""
    return BATCH_INVARIANT if self.matmul == "cpu_kernel" else FAST

  @property
  def cache_dtype(self):
    """The KV cache's dtype, and so attention's: the model dtype, except float32 in the batch-invariant
    mode (around the CPU matmul kernel XLA:CPU runs attention, and its bfloat16 dots are slow and made
    it convert every layer's cache to float32 inside each layer's attention loop). bfloat16 keys and
    values are held exactly in float32."""
    return jnp.dtype(jnp.float32) if self.numerics == BATCH_INVARIANT else self.jnp_dtype

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    """Parameter count implied by the config (for reports and memory estimates)."""
    attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
    attn += 2 * self.head_dim * self.qk_norm
    if self.arch == "gpt2":
      attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads) + self.d_model
      mlp = 2 * self.d_model * self.d_ff + self.d_ff + self.d_model
      norms = 4 * self.d_model
    else:
      attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads) * self.qkv_bias
      mlp = 3 * self.d_model * self.d_ff
      norms = (4 if self.arch == "gemma" else 2) * self.d_model
    total = self.n_layers * (attn + mlp + norms) + self.vocab_size * self.d_model
    total += self.d_model * (2 if self.arch == "gpt2" else 1)
    total += self.max_positions * self.d_model if self.arch == "gpt2" else 0
    total += 0 if self.tie_embeddings else self.vocab_size * self.d_model
    return total
