"""Token-level divergences between the teacher (target) and the student (draft), over the full vocabulary.

Notation follows `specjax.sampling`'s acceptance rule: q is the target's (teacher's) distribution, p the
draft's (student's). Speculative decoding accepts a draft token x with probability min(1, q(x)/p(x)),
so the expected acceptance of one step is sum_x min(p(x), q(x)) = 1 - TVD(q, p); the divergences below
are the ones DistillSpec (Zhou et al., 2023) compares for pulling p toward q:

  forward_kl  KL(q || p) = sum q (log q - log p)       mean-seeking: the usual distillation loss
  reverse_kl  KL(p || q) = sum p (log p - log q)       mode-seeking
  jsd         beta KL(q || m) + (1 - beta) KL(p || m),  m = beta q + (1 - beta) p   (generalized JSD)
  tvd         (1/2) sum |q - p|                         directly 1 - expected acceptance

Everything is computed from float32 log-probabilities (`log_softmax` of logits / temperature), so no
probability that underflows turns into log 0. Per-token values are reduced by `masked_mean` over the
valid tokens only (padding and prompt positions carry mask 0).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tvd")


def check_divergence(name: str, beta: float) -> None:
  """Raises a ValueError naming the choices for an unknown divergence or a JSD beta outside (0, 1)."""
  if name not in DIVERGENCES:
    raise ValueError(f"unknown divergence {name!r}; expected one of {DIVERGENCES}")
  if name == "jsd" and not 0.0 < beta < 1.0:
    raise ValueError(f"jsd needs 0 < beta < 1 (the teacher's weight in the mixture), got {beta}")


def log_probs(logits_xV: jax.Array, temperature: float) -> jax.Array:
  """Float32 log-probabilities [..., V] of logits / temperature."""
  return jax.nn.log_softmax(logits_xV.astype(jnp.float32) / temperature, axis=-1)


def _kl(log_a_xV: jax.Array, log_b_xV: jax.Array) -> jax.Array:
  """KL(a || b) [...] from log-probabilities; terms with a = 0 contribute 0."""
  a_xV = jnp.exp(log_a_xV)
  return jnp.sum(jnp.where(a_xV > 0, a_xV * (log_a_xV - log_b_xV), 0.0), axis=-1)


def token_divergence(name: str, teacher_logits_xV: jax.Array, student_logits_xV: jax.Array, temperature: float = 1.0,
                     beta: float = 0.5) -> jax.Array:
  """The divergence `name` between teacher and student at every position: float32 [...]."""
  check_divergence(name, beta)
  log_q_xV = log_probs(teacher_logits_xV, temperature)
  log_p_xV = log_probs(student_logits_xV, temperature)
  if name == "forward_kl":
    return _kl(log_q_xV, log_p_xV)
  if name == "reverse_kl":
    return _kl(log_p_xV, log_q_xV)
  if name == "jsd":
    log_m_xV = jnp.logaddexp(math.log(beta) + log_q_xV, math.log1p(-beta) + log_p_xV)
    return beta * _kl(log_q_xV, log_m_xV) + (1.0 - beta) * _kl(log_p_xV, log_m_xV)
  return 0.5 * jnp.sum(jnp.abs(jnp.exp(log_q_xV) - jnp.exp(log_p_xV)), axis=-1)


def expected_acceptance(teacher_logits_xV: jax.Array, student_logits_xV: jax.Array,
                        temperature: float = 1.0) -> jax.Array:
  """sum_x min(p(x), q(x)) at every position [...]: the probability that speculative sampling at this
  temperature accepts the draft's token (top-k/top-p off)."""
  q_xV = jnp.exp(log_probs(teacher_logits_xV, temperature))
  p_xV = jnp.exp(log_probs(student_logits_xV, temperature))
  return jnp.sum(jnp.minimum(p_xV, q_xV), axis=-1)


def greedy_agreement(teacher_logits_xV: jax.Array, student_logits_xV: jax.Array) -> jax.Array:
  """1.0 where the argmaxes agree (greedy speculative decoding accepts the draft token), else 0.0 [...]."""
  return (jnp.argmax(teacher_logits_xV, -1) == jnp.argmax(student_logits_xV, -1)).astype(jnp.float32)


def masked_mean(values_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """Mean of `values_BxT` over the positions where `mask_BxT` is set; 0 when nothing is valid."""
  mask_BxT = mask_BxT.astype(jnp.float32)
  return jnp.sum(values_BxT * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)
