"""The self-speculative (layer-skip) drafter: greedy output equals the target's own for ragged batches,
an EOS inside a block, K = 1 and K = 8; with every layer selected it is the target and every draft
token is accepted; sampled output follows the target's exact distribution at T = 0.7 with top-k (and a
broken rule fails the same test); it shares the target's cache (no storage); bad layer sets fail early."""

import pytest

from specjax import metrics, testing
from specjax.generation import as_token_lists
from specjax.sampling import sampling_params
from specjax.speculative import verify
from specjax.speculative.drafters.layer_skip import LayerSkipDrafter, parse_layers
from specjax.speculative.loop import SpeculativeLoop
from tests.helpers.engine import (BUDGETS, CACHE_LEN, GREEDY, NO_EOS, OUT_WIDTH, PROMPTS, SAMPLE_PROMPT, SAMPLE_STEPS,
                                  accept_all, first_tokens_pvalue, tiny_model)
from tests.helpers.layer_skip import SMALL_TARGET, TARGET, target_greedy_3
from tests.helpers.stats import SAMPLE_ROWS


def _run(target, layers, k, prompts=PROMPTS, budgets=BUDGETS, eos_ids=NO_EOS, sampling=GREEDY, seed=0, rule=verify,
         out_width=OUT_WIDTH, cache_len=CACHE_LEN):
  config, params = target
  return testing.speculate(SpeculativeLoop(config, k, out_width, rule=rule), params,
                           LayerSkipDrafter(config, params, layers),
                           testing.request(prompts, budgets, sampling, seed=seed, eos_ids=eos_ids), cache_len=cache_len)


# K = 1 and 8 with a partial draft; one skipped layer, and every layer (each draft token accepted), at K = 8.
@pytest.mark.parametrize("layers, k", [((0, 2), 1), ((0, 2), 8), ((0,), 8), ((0, 1, 2), 8)])
def test_greedy_equals_target_greedy(layers, k):
  out = _run(TARGET, layers, k)
  assert as_token_lists(out.tokens, out.counts) == target_greedy_3()
  total = metrics.summarize(out.acceptance)["total"]
  if layers == (0, 1, 2):  # the draft is the target: everything accepted
    assert total["accepted"] == total["proposed"] > 0
  else:
    assert total["accepted"] < total["proposed"]


def test_eos_inside_an_accepted_block():
  free = target_greedy_3()[0]
  eos = [free[5]]
  out = _run(TARGET, (0, 1, 2), 8, eos_ids=eos)
  assert as_token_lists(out.tokens, out.counts) == target_greedy_3(eos_ids=eos)
  assert as_token_lists(out.tokens, out.counts)[0] == free[:free.index(eos[0]) + 1]


@pytest.mark.parametrize("rule, passes", [(verify, True), (accept_all, False)])
def test_sampled_tokens_follow_the_exact_target_distribution(rule, passes):
  """T = 0.7, top-k 5, K = 2, first 3 tokens of N = SAMPLE_ROWS rows; chi-square at level 0.001 (the broken
  rule must give p < 1e-12). The 1-layer draft is accepted in part: both branches of the rule matter."""
  sampling, rows = sampling_params(0.7, top_k=5), SAMPLE_ROWS
  out = _run(SMALL_TARGET, (0,), 2, prompts=[SAMPLE_PROMPT] * rows, budgets=SAMPLE_STEPS, sampling=sampling, seed=1,
             rule=rule, out_width=SAMPLE_STEPS, cache_len=len(SAMPLE_PROMPT) + SAMPLE_STEPS + 2)
  pvalue = first_tokens_pvalue(SMALL_TARGET, SAMPLE_PROMPT, sampling, out.tokens)
  if passes:
    total = metrics.summarize(out.acceptance)["total"]
    assert 0.2 < total["acceptance_rate"] < 0.95 and pvalue > 1e-3
  else:
    assert pvalue < 1e-12


@pytest.mark.parametrize("spec, expected", [("0-2", (0, 1, 2)), ("2, 0", (0, 2)), ("1,0-1", (0, 1))])
def test_parse_layers(spec, expected):
  assert parse_layers(spec, 3) == expected


@pytest.mark.parametrize("spec, message", [("", "selects no layer"), ("0-3", r"must lie in 0-2"),
                                           ("2-1", "runs backwards"), ("a", "is not a layer index")])
def test_bad_layer_sets_fail(spec, message):
  with pytest.raises(ValueError, match=message):
    parse_layers(spec, 3)


def test_drafter_must_be_the_targets_own_layers():
  other = tiny_model(1, n_layers=3, d_model=16)
  with pytest.raises(ValueError, match="config must be the target's"):
    LayerSkipDrafter(other[0], other[1], (0,)).check(TARGET[0])
