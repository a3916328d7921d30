"""The speculative acceptance rule (Leviathan et al. 2023, Chen et al. 2023): pure functions on
probabilities, in float32.

For each row, draft token x_i (drawn from p_i) is accepted with probability min(1, q_i(x_i) / p_i(x_i))
while every earlier one was; at the first rejection the next token is drawn from the residual
norm(max(0, q_n - p_n)), and after K acceptances the bonus token is drawn from q_{K+1}. A row may
propose fewer than K tokens (its later slots are never accepted, and the bonus comes from the q after
its last proposed token), and a deterministic drafter proposes point masses (p(x) = 1: x is accepted
with probability q(x), the residual is q without x). Every emitted
token is then distributed exactly as the target's q, whatever the draft's p, provided p and q are the
very distributions the samplers use (the same `sampling.probabilities` output).

Draft and target may have different vocabulary sizes (the same tokenizer, with padding rows in one
head: Qwen2.5-0.5B scores 151,936 ids, Qwen2.5-7B 152,064). The smaller distribution is then extended
with probability 0 for the ids it lacks, which keeps the rule exact: a draft token the target's head
lacks has q = 0 and is always rejected, the draft's mass on such ids never enters the residual
max(0, q - p) (q is 0 there), and the target's ids the draft lacks come from the residual with p = 0.
The extension is a lookup that yields 0 outside a distribution (`_probability_of`) and a zero-pad or
cut of the one draft row a residual needs (`residual`): no padded [B, K, V] tensor is built.

Greedy decoding compares token ids instead (`verify_greedy`): a row accepts its leading draft tokens
equal to the target's argmax and emits the target's argmax after them. That is what `verify` does on
one-hot p and q (u * p(x) < q(x), with u in [0, 1), holds exactly when x is the target's argmax, and
the residual after a rejection is the target's one-hot), without building any [B, K, V] or [B, V]
tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import sample
from specjax.speculative.proposal import Proposal


def _fit_vocab(draft_probs_xW: jax.Array, vocab: int) -> jax.Array:
  """The draft's distribution over W ids as one over the target's V ids: zero-padded when W < V, cut
  when W > V (its mass on ids >= V, where q = 0, can never be part of max(0, q - p))."""
  width = draft_probs_xW.shape[-1]
  if width >= vocab:
    return draft_probs_xW[..., :vocab]
  return jnp.pad(draft_probs_xW, [(0, 0)] * (draft_probs_xW.ndim - 1) + [(0, vocab - width)])


def _probability_of(probs_KxV: jax.Array, tokens_K: jax.Array) -> jax.Array:
  """probs[i, tokens[i]] [K], 0 for ids >= V: a distribution extended with zeros beyond its vocabulary."""
  vocab = probs_KxV.shape[-1]
  found_K = jnp.take_along_axis(probs_KxV, jnp.minimum(tokens_K, vocab - 1)[:, None], axis=-1)[:, 0]
  return jnp.where(tokens_K < vocab, found_K, 0.0)


def residual(target_probs_xV: jax.Array, draft_probs_xW: jax.Array) -> jax.Array:
  """norm(max(0, q - p)) [..., V]: the distribution to draw from after a rejection. The draft's
  distribution may span another number W of ids: it is extended with zeros (or cut) to the target's V.

  Falls back to q where the positive part sums to zero, which only happens when p equals q up to
  float32 rounding (a rejection then has probability ~0 and q is the exact answer anyway).
  """
  excess_xV = jnp.maximum(target_probs_xV - _fit_vocab(draft_probs_xW, target_probs_xV.shape[-1]), 0.0)
  total_x1 = excess_xV.sum(axis=-1, keepdims=True)
  return jnp.where(total_x1 > 0.0, excess_xV / jnp.where(total_x1 > 0.0, total_x1, 1.0), target_probs_xV)


def _verify_row(key: jax.Array, tokens_K: jax.Array, length: jax.Array, draft_probs_KxW: jax.Array | None,
                target_probs_K1xV: jax.Array) -> tuple[jax.Array, jax.Array]:
  K = tokens_K.shape[0]
  uniform_key, residual_key = jax.random.split(key)
  if K == 0:  # a verify pass of the pending token alone: the next token comes from q_1
    return jnp.int32(0), sample(residual_key, target_probs_K1xV[0])
  q_K = _probability_of(target_probs_K1xV[:K], tokens_K)
  if draft_probs_KxW is None:  # point masses: p(d_i) = 1
    p_K = jnp.ones((K,), jnp.float32)
  else:
    p_K = _probability_of(draft_probs_KxW, tokens_K)
  accepted_K = (jax.random.uniform(uniform_key, (K,), jnp.float32) * p_K < q_K) & (jnp.arange(K) < length)
  num_accepted = jnp.sum(jnp.cumprod(accepted_K.astype(jnp.int32)))
  # After the last proposed token there is no draft distribution: the residual against p = 0 is q.
  rejected = num_accepted < length
  at = jnp.minimum(num_accepted, K - 1)
  if draft_probs_KxW is None:  # one_hot of an id >= V is all zeros: the point mass lies outside q
    draft_n_W = jnp.where(rejected, jax.nn.one_hot(tokens_K[at], target_probs_K1xV.shape[-1], dtype=jnp.float32), 0.0)
  else:
    draft_n_W = jnp.where(rejected, draft_probs_KxW[at], 0.0)
  next_token = sample(residual_key, residual(target_probs_K1xV[num_accepted], draft_n_W))
  return num_accepted.astype(jnp.int32), next_token


def verify(key: jax.Array, proposal: Proposal, target_probs_BxK1xV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Accepts a prefix of each row's proposed draft tokens and draws the token that follows it.

  Args:
    key: this round's PRNG key; row b uses `fold_in(key, b)`, so rows never share randomness and a
      row's draw does not depend on the batch size.
    proposal: draft tokens [B, K], x_i drawn from p_i = `proposal.probs[:, i]` [B, K, W] (or a point mass:
      then x_i is accepted with probability q_i(x_i) and the residual is q_i without x_i, renormalised);
      row b proposes only its first `proposal.lengths[b]` tokens. W may differ from V (see the module
      docstring: the smaller distribution is extended with zeros).
    target_probs_BxK1xV: float32 target distributions q_1..q_{K+1}, q_i scored at the position of x_i.

  Returns:
    num_accepted_B: int32 number n of leading draft tokens accepted (0..lengths[b]).
    next_token_B: int32 token emitted after them: from the residual of q_{n+1} and p_{n+1} when
      n < lengths[b], from q_{n+1} itself (the bonus token) when every proposed token was accepted.
  """
  row_keys_B = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(proposal.tokens.shape[0]))
  if proposal.probs is None:
    return jax.vmap(lambda key, tokens, length, target: _verify_row(key, tokens, length, None, target))(
        row_keys_B, proposal.tokens, proposal.lengths, target_probs_BxK1xV)
  return jax.vmap(_verify_row)(row_keys_B, proposal.tokens, proposal.lengths, proposal.probs, target_probs_BxK1xV)


def verify_greedy(proposal: Proposal, target_tokens_BxK1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The greedy rule on token ids: `verify` for one-hot distributions, without them.

  Args:
    proposal: draft tokens [B, K]; row b proposes its first `proposal.lengths[b]` (`probs` is unused).
    target_tokens_BxK1: int32 target argmaxes t_1..t_{K+1}, t_i scored at the position of d_i.

  Returns:
    num_accepted_B: int32 number n of leading proposed draft tokens equal to the target's argmax (a
      draft id the target's head lacks never is).
    next_token_B: int32 t_{n+1}, the target's argmax after them.
  """
  k = proposal.k
  proposed_BxK = jnp.arange(k)[None, :] < proposal.lengths[:, None]
  matches_BxK = (proposal.tokens == target_tokens_BxK1[:, :k]) & proposed_BxK
  num_accepted_B = jnp.sum(jnp.cumprod(matches_BxK.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
  return num_accepted_B, jnp.take_along_axis(target_tokens_BxK1, num_accepted_B[:, None], axis=1)[:, 0]
