"""The generate loops with their parts spelled out as arguments (the loop's settings, the request, the
policy's tables), as most tests call them."""

from specjax import autoregressive
from specjax.generation import Request
from specjax.speculative import acceptance
from specjax.speculative.k_policy import KPolicy, Tables
from specjax.speculative.loop import SpeculativeLoop, speculative_generate
from specjax.speculative.trees import acceptance as tree_acceptance


def speculate(target_config, target_params, drafter, prompts_BxP, prompt_lengths_B, target_cache, draft_storage,
              max_new_tokens, eos_ids, sampling, key, *, k, out_width=None, pad_id=0, policy=KPolicy(),
              rule=acceptance.verify, greedy_rule=acceptance.verify_greedy, tree_rule=tree_acceptance.verify_tree,
              cost_C=None, prior_AxK=None, full=False, round_limit=None, lower=False):
  """`speculative_generate` with its settings, request and tables spelled out."""
  loop = SpeculativeLoop(target_config, k, out_width, pad_id, policy, rule, greedy_rule, tree_rule)
  request = Request(prompts_BxP, prompt_lengths_B, max_new_tokens, eos_ids, sampling, key, round_limit)
  return speculative_generate(loop, target_params, drafter, request, target_cache, draft_storage,
                              Tables(cost_C, prior_AxK, full), lower)


def autoregress(config, params, prompts_BxP, prompt_lengths_B, cache, max_new_tokens, eos_ids, sampling, key, *,
                out_width=None, pad_id=0, lower=False):
  """`autoregressive.generate` with the request spelled out as arguments."""
  request = Request(prompts_BxP, prompt_lengths_B, max_new_tokens, eos_ids, sampling, key)
  return autoregressive.generate(config, params, request, cache, out_width=out_width, pad_id=pad_id, lower=lower)
