"""The parallel drafter's test kit: its runner on the tiny engine models and its mutants.

Mutants (subclasses of `ParallelDrafter`, each one plausible bug; the tests must reject them):
- `FirstDistributionReported`: every position's reported distribution is q_1 (pending's), while d_i is
  still drawn from q_i: the rule is handed a distribution the token was not drawn from.
- `OneKeyPerBlock`: every position of the block is drawn with the round's one key (not a key each):
  each d_i still has q_i as its marginal, but d_2 is no longer drawn independently of d_1, which the
  chain rule needs (the same noise picks the same rank in similar distributions).
- `MaskEntriesKept`: `commit` keeps the mask pass's cache entries as if they were the accepted tokens'
  (the cache advances past [lag, pending, d_1 .. d_n], nothing lags): the next round reads masks where
  the history holds d_1 .. d_n. Still exact (any draft distribution is), only a worse draft.
"""

import jax.numpy as jnp

from specjax import testing
from specjax.sampling import tokens_and_probabilities
from specjax.speculative.drafters.parallel import ParallelDraftState, ParallelDrafter
from specjax.speculative.k_policy import Tables
from specjax.speculative.loop import SpeculativeLoop
from tests.helpers import engine


class FirstDistributionReported(ParallelDrafter):
  def propose(self, state, target_cache, pending_B, sampling, key, plan):
    proposal, state, target_cache = super().propose(state, target_cache, pending_B, sampling, key, plan)
    probs_BxKxW = None if proposal.probs is None else jnp.broadcast_to(proposal.probs[:, :1], proposal.probs.shape)
    return proposal.replace(probs=probs_BxKxW), state, target_cache


class OneKeyPerBlock(ParallelDrafter):
  def draw(self, key, logits_BxKxW, sampling):
    drawn = [tokens_and_probabilities(key, logits_BxKxW[:, i], sampling) for i in range(logits_BxKxW.shape[1])]
    probs = None if drawn[0][1] is None else jnp.stack([p for _, p in drawn], axis=1)
    return jnp.stack([token for token, _ in drawn], axis=1), probs


class MaskEntriesKept(ParallelDrafter):
  def commit(self, state, proposal, num_committed_B, target_features_BxK1xF):
    committed_B = num_committed_B > 0
    return ParallelDraftState(cache=state.cache.advance(jnp.where(committed_B, state.lag + num_committed_B, 0)),
                              lag_ids_BxK=state.lag_ids_BxK, lag=jnp.where(committed_B, 0, state.lag))


def run_parallel(draft, mask_id, k=3, cls=ParallelDrafter, target=engine.TARGET, prompts=engine.PROMPTS,
                 budgets=engine.BUDGETS, sampling=engine.GREEDY, seed=0, cache_len=engine.CACHE_LEN,
                 out_width=engine.OUT_WIDTH, tables=Tables(), **settings):
  """Speculative decoding of `prompts` by `target` with `draft` (a model) as a parallel drafter `cls`;
  `settings` are the loop's (`SpeculativeLoop`), `tables` the K policy's."""
  (target_config, target_params), (draft_config, draft_params) = target, draft
  drafter = cls(draft_config, draft_params, mask_id, k)
  return testing.speculate(SpeculativeLoop(target_config, k, out_width, **settings), target_params, drafter,
                           testing.request(prompts, budgets, sampling, seed=seed, eos_ids=engine.NO_EOS),
                           cache_len=cache_len, tables=tables)
