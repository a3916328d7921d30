"""Logits -> processed probabilities (temperature, top-k, top-p) -> tokens. The one place for it.

Speculative decoding is exact only if the acceptance ratio q(x)/p(x) uses the very distributions the
tokens were drawn from, so every generate loop calls `probabilities` and then `sample` on its output.
Greedy decoding (temperature 0) is the point mass on the argmax. The knobs are runtime arrays, not
static: changing them does not recompile.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class SamplingParams:
  temperature: jax.Array  # [] float32; 0 means greedy (point mass on the argmax)
  top_k: jax.Array  # [] int32; keep the k most likely tokens, 0 disables
  top_p: jax.Array  # [] float32; keep the smallest set of mass >= top_p (nucleus), 1 disables

  @property
  def greedy(self) -> jax.Array:
    return self.temperature <= 0.0


def sampling_params(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
  """Validated `SamplingParams` from Python numbers; bad values fail here, not inside XLA."""
  if not temperature >= 0.0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
  if int(top_k) != top_k or top_k < 0:
    raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")
  return SamplingParams(temperature=jnp.float32(temperature), top_k=jnp.int32(top_k),
                        top_p=jnp.float32(top_p))


def _top_k_mask(logits_NxV: jax.Array, k: jax.Array) -> jax.Array:
  k = jnp.minimum(k, logits_NxV.shape[-1])  # k >= V keeps everything (an out-of-range index gives NaN)
  kth_largest_N = jnp.take_along_axis(-jnp.sort(-logits_NxV, axis=-1),
                                      jnp.broadcast_to(k - 1, logits_NxV.shape[:-1] + (1,)), axis=-1)
  return jnp.where(logits_NxV >= kth_largest_N, logits_NxV, -jnp.inf)


def _top_p_mask(logits_NxV: jax.Array, p: jax.Array) -> jax.Array:
  probs_NxV = jax.nn.softmax(logits_NxV, axis=-1)
  sorted_NxV = -jnp.sort(-probs_NxV, axis=-1)
  mass_before_NxV = jnp.cumsum(sorted_NxV, axis=-1) - sorted_NxV
  kept_NxV = mass_before_NxV < p  # the first token is always kept (mass before it is 0)
  smallest_kept_Nx1 = jnp.min(jnp.where(kept_NxV, sorted_NxV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(probs_NxV >= smallest_kept_Nx1, logits_NxV, -jnp.inf)


def probabilities(logits_xV: jax.Array, params: SamplingParams) -> jax.Array:
  """Float32 probabilities [..., V] after temperature, then top-k, then top-p (the HF order)."""
  logits_NxV = logits_xV.astype(jnp.float32).reshape(-1, logits_xV.shape[-1])

  def sampled(logits_NxV):
    scaled_NxV = logits_NxV / params.temperature
    scaled_NxV = jax.lax.cond(params.top_k > 0, lambda x: _top_k_mask(x, params.top_k),
                              lambda x: x, scaled_NxV)
    scaled_NxV = jax.lax.cond(params.top_p < 1.0, lambda x: _top_p_mask(x, params.top_p),
                              lambda x: x, scaled_NxV)
    return jax.nn.softmax(scaled_NxV, axis=-1)

  def greedy(logits_NxV):
    return jax.nn.one_hot(jnp.argmax(logits_NxV, axis=-1), logits_NxV.shape[-1], dtype=jnp.float32)

  probs_NxV = jax.lax.cond(params.greedy, greedy, sampled, logits_NxV)
  return probs_NxV.reshape(logits_xV.shape)


def sample(key: jax.Array, probs_xV: jax.Array) -> jax.Array:
  """Tokens [...] drawn from float32 probabilities [..., V]; a point mass returns its token exactly.

  When every distribution is a point mass (greedy decoding) the argmax is taken without drawing the
  Gumbel noise: that noise costs ~8 ms per draw over a 152k vocabulary on a CPU, paid K + 1 times a
  round. (Under `vmap` the branch becomes a select and both sides run; the result is the same.)
  """
  def draw():
    return jax.random.categorical(key, jnp.log(probs_xV), axis=-1).astype(jnp.int32)

  def argmax():
    return jnp.argmax(probs_xV, axis=-1).astype(jnp.int32)

  point_masses = jnp.all(jnp.sum(probs_xV > 0.0, axis=-1) == 1)  # one nonzero entry per row
  return jax.lax.cond(point_masses, argmax, draw)
