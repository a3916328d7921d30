"""Jump-forward under a constraint: a state that allows a single token forces it. A lookup drafter
proposes forced tokens itself (`Constrained.force`), which the masked target accepts with certainty;
the stats count every generated token a constraint forced (`jump_forward`). Greedy output still equals
the oracle-masked reference, the count equals the oracle's on a constraint that forces a known number
of tokens, and at T = 1 the first tokens still follow the masked, renormalised target."""

import jax.numpy as jnp
import numpy as np

from specjax import metrics, testing
from specjax.generation import as_token_lists
from specjax.sampling import sampling_params
from specjax.speculative.drafters.ngram import NgramDrafter
from specjax.speculative.loop import SpeculativeLoop
from specjax.speculative.proposal import Proposal
from tests.helpers import engine
from tests.helpers.constraints import (DIGITS_REGEX, EOS, STRINGS_8, STRINGS_61, device_constraint,
                                       exact_constrained_distribution, greedy_reference, oracle_mask)
from tests.helpers.stats import chi_square_pvalue

# "f", "j" and "5" each start no other token of STRINGS_61 that fits: forced; then a choice; then only EOS.
FORCING = "fj5(7|8)"
PATTERNS = [FORCING, DIGITS_REGEX]  # rows 0 and 2 under the first, row 1 under the second


def _oracle_forced(pattern, strings, tokens):
  """How many of `tokens` the oracle allowed alone (its mask held only them)."""
  forced, text = 0, b""
  for token in tokens:
    forced += int(oracle_mask(pattern, strings, text).sum() == 1)
    text += strings[token]
  return forced


def test_greedy_lookup_with_jump_forward_equals_the_reference_and_counts_the_forced_tokens():
  """The n-gram drafter, whose lookups find nothing after "fj": its accepted tokens on the forcing rows
  are the forced proposals; the counts (the first token included) are the oracle's: 4 there."""
  config, params = engine.TARGET
  rows = len(engine.PROMPTS)
  sampling = sampling_params(0.0).replace(constraint=device_constraint(PATTERNS, STRINGS_61, rows))
  out = testing.speculate(SpeculativeLoop(config, 3, engine.OUT_WIDTH), params, NgramDrafter(vocab_size=engine.VOCAB),
                          testing.request(engine.PROMPTS, engine.BUDGETS, sampling, eos_ids=[EOS]),
                          cache_len=engine.CACHE_LEN)
  tokens = as_token_lists(out.tokens, out.counts)
  patterns = [PATTERNS[i % 2] for i in range(rows)]
  assert tokens == [
      greedy_reference(engine.TARGET, [p], [b], pattern, STRINGS_61)[0]
      for p, b, pattern in zip(engine.PROMPTS, engine.BUDGETS, patterns)
  ]
  rows = metrics.summarize(out.acceptance)["per_row"]
  assert [row["jump_forward"] for row in rows] == [_oracle_forced(p, STRINGS_61, t) for p, t in zip(patterns, tokens)]
  assert rows[0]["jump_forward"] == rows[2]["jump_forward"] == 4 and tokens[0][-1] == EOS
  # j and 5, then EOS three times (forced again after itself; the output keeps one): proposed by no lookup.
  assert rows[0]["accepted"] == rows[2]["accepted"] == 5


def test_force_fills_single_allowed_positions_and_extends_a_lookup():
  """From the start of FORCING: a lookup [x, x, x] of length 1 becomes [f, j, 5] of length 3 (all
  forced); from after "fj5" (a choice, then only EOS, which leaves the state as it is) [7, 9, 9] of
  length 1 becomes [7, EOS, EOS] of length 3, and [9, 9, 9] stays of length 0 at its unforced first
  position."""
  table = device_constraint([FORCING], STRINGS_61, 1)
  f, j, five, seven, nine = (STRINGS_61.index(bytes(c, "ascii")) for c in "fj579")
  start = table.replace(state=jnp.asarray([0, 0]))
  lookup = Proposal(tokens=jnp.asarray([[9, 9, 9], [nine, nine, nine]]), lengths=jnp.asarray([1, 0]))
  forced = start.force(lookup)
  assert forced.tokens.tolist()[0] == [f, j, five] and forced.lengths.tolist() == [3, 3]
  choice = start.after(jnp.asarray([[f, j, five]] * 2), 3)
  forced = choice.force(lookup.replace(tokens=jnp.asarray([[seven, nine, nine], [nine, nine, nine]])))
  assert forced.tokens.tolist()[0] == [seven, EOS, EOS] and forced.lengths.tolist() == [3, 0]


# -- T = 1 on the 8-id model: after "x" only "x" may follow -------------------------------------------------
SMALL_FORCING = "(xx|c)+"
ROWS, ALPHA = 2_000, 1e-4


def test_sampled_lookup_with_jump_forward_follows_the_constrained_target():
  """The first SAMPLE_STEPS tokens of the n-gram drafter with forced proposals, chi-square against the
  masked, renormalised target enumerated exactly (2,000 rows, level 1e-4); forced tokens were generated."""
  config, params = engine.SMALL_TARGET
  drafter = NgramDrafter(vocab_size=len(STRINGS_8))
  sampling = sampling_params(1.0).replace(constraint=device_constraint([SMALL_FORCING], STRINGS_8, ROWS))
  request = testing.request([engine.SAMPLE_PROMPT] * ROWS, engine.SAMPLE_STEPS, sampling, seed=4, eos_ids=[EOS])
  out = testing.speculate(SpeculativeLoop(config, 2, engine.SAMPLE_STEPS), params, drafter, request, cache_len=16)
  tokens = np.asarray(out.tokens)
  exact = exact_constrained_distribution(engine.SMALL_TARGET, engine.SAMPLE_PROMPT, SMALL_FORCING, STRINGS_8, 1.0,
                                         engine.SAMPLE_STEPS).ravel()
  index = np.ravel_multi_index(tokens.T, [len(STRINGS_8)] * tokens.shape[1])
  assert chi_square_pvalue(np.bincount(index, minlength=exact.size), exact) > ALPHA
  assert int(out.acceptance.forced.sum()) == sum(
      _oracle_forced(SMALL_FORCING, STRINGS_8, row[:count]) for row, count in zip(tokens, np.asarray(out.counts))) > 0
