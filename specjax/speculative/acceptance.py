"""The speculative acceptance rule (Leviathan et al. 2023, Chen et al. 2023): pure functions on
probabilities, in float32.

For each row, draft token x_i (drawn from p_i) is accepted with probability min(1, q_i(x_i) / p_i(x_i))
while every earlier one was; at the first rejection the next token is drawn from the residual
norm(max(0, q_n - p_n)), and after K acceptances the bonus token is drawn from q_{K+1}. Every emitted
token is then distributed exactly as the target's q, whatever the draft's p, provided p and q are the
very distributions the samplers use (the same `sampling.probabilities` output).

Greedy decoding needs no separate path: at temperature 0 both p and q are one-hot, so u * p(x) < q(x)
(with u in [0, 1)) holds exactly when x is the target's argmax, the residual max(0, q - p) after a
rejection is the target's one-hot, and `sample` returns a point mass's token exactly. The output is
therefore the target's greedy token, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import sample


def residual(target_probs_xV: jax.Array, draft_probs_xV: jax.Array) -> jax.Array:
  """norm(max(0, q - p)): the distribution to draw from after a rejection.

  Falls back to q where the positive part sums to zero, which only happens when p equals q up to
  float32 rounding (a rejection then has probability ~0 and q is the exact answer anyway).
  """
  excess_xV = jnp.maximum(target_probs_xV - draft_probs_xV, 0.0)
  total_x1 = excess_xV.sum(axis=-1, keepdims=True)
  return jnp.where(total_x1 > 0.0, excess_xV / jnp.where(total_x1 > 0.0, total_x1, 1.0), target_probs_xV)


def _verify_row(key: jax.Array, tokens_K: jax.Array, draft_probs_KxV: jax.Array,
                target_probs_K1xV: jax.Array) -> tuple[jax.Array, jax.Array]:
  K = tokens_K.shape[0]
  uniform_key, residual_key = jax.random.split(key)
  p_K = jnp.take_along_axis(draft_probs_KxV, tokens_K[:, None], axis=-1)[:, 0]
  q_K = jnp.take_along_axis(target_probs_K1xV[:K], tokens_K[:, None], axis=-1)[:, 0]
  accepted_K = jax.random.uniform(uniform_key, (K,), jnp.float32) * p_K < q_K
  num_accepted = jnp.sum(jnp.cumprod(accepted_K.astype(jnp.int32)))
  # After a full acceptance there is no draft distribution at K+1: the residual against p = 0 is q.
  draft_n_V = jnp.where(num_accepted < K, draft_probs_KxV[jnp.minimum(num_accepted, K - 1)], 0.0)
  next_token = sample(residual_key, residual(target_probs_K1xV[num_accepted], draft_n_V))
  return num_accepted.astype(jnp.int32), next_token


def verify(key: jax.Array, draft_tokens_BxK: jax.Array, draft_probs_BxKxV: jax.Array,
           target_probs_BxK1xV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Accepts a prefix of each row's K draft tokens and draws the token that follows it.

  Args:
    key: this round's PRNG key; row b uses `fold_in(key, b)`, so rows never share randomness and a
      row's draw does not depend on the batch size.
    draft_tokens_BxK: int32 draft tokens, x_i drawn from `draft_probs_BxKxV[:, i]`.
    draft_probs_BxKxV: float32 draft distributions p_1..p_K.
    target_probs_BxK1xV: float32 target distributions q_1..q_{K+1}, q_i scored at the position of x_i.

  Returns:
    num_accepted_B: int32 number n of leading draft tokens accepted (0..K).
    next_token_B: int32 token emitted after them: from the residual of q_{n+1} and p_{n+1} when
      n < K, from q_{K+1} when n = K.
  """
  row_keys_B = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(draft_tokens_BxK.shape[0]))
  return jax.vmap(_verify_row)(row_keys_B, draft_tokens_BxK, draft_probs_BxKxV, target_probs_BxK1xV)
