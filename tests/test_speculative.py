"""The speculative engine end to end.

Greedy: output equal to the target's own greedy decoding (`autoregressive.generate`) token for token,
for mixed prompt lengths, per-row budgets that are not multiples of K + 1, an EOS inside an accepted
block, K = 1, 3 and 8, and drafts that agree always, never, partly or are a different architecture;
the acceptance metrics say what each draft should get.
Sampling: the first three generated tokens, over many seeded rows, follow the target's exact
distribution (by enumeration) at temperature 1, with a full and a restricted draft head, and a broken
acceptance rule fails the same test (top-k, top-p and other temperatures: test_exactness). The
drafter's cache bookkeeping is checked against full forward passes, and bad inputs fail on the host.
A drafter subclass with its parent's fields compiles a program of its own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import lowering, metrics, testing
from specjax.generation import as_token_lists, pad_prompts
from specjax.models.kv_cache import KVCache
from specjax.sampling import sampling_params
from specjax.speculative import verify
from specjax.speculative.drafters.draft_head import restrict_head
from specjax.speculative.plan import RoundPlan
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.loop import SpeculativeLoop, speculative_generate
from tests.helpers.engine import (BUDGETS, CACHE_LEN, DRAFTS, GREEDY, OUT_WIDTH, PROMPTS, SAMPLE_PROMPT, SAMPLE_STEPS,
                                  SMALL_DRAFT, SMALL_TARGET, TARGET, VOCAB, accept_all, exact_distribution,
                                  forced_draft_rounds, FORCED_DRAFT_PROMPTS, run_speculative, target_greedy, tiny_model)
from tests.helpers.stats import SAMPLE_ROWS, chi_square_pvalue


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("draft_name", sorted(DRAFTS))
def test_greedy_equals_target_greedy(draft_name, k):
  out = run_speculative(DRAFTS[draft_name], k=k)
  assert as_token_lists(out.tokens, out.counts) == target_greedy()
  assert out.tokens.shape == (len(PROMPTS), OUT_WIDTH)
  np.testing.assert_array_equal(out.counts, BUDGETS)
  summary = metrics.summarize(out.acceptance)
  rounds = np.asarray(out.acceptance.rounds)
  assert int(out.target_calls) == rounds.max() + 1 and int(out.draft_calls) == k * rounds.max()
  if draft_name == "same":  # every draft token accepted, including after each full acceptance
    assert summary["total"]["accepted"] == summary["total"]["proposed"] > 0
    assert summary["total"]["alpha_hat"] == 1.0 and summary["total"]["mean_accepted_length"] == k + 1
    np.testing.assert_array_equal(rounds, -(-(np.array(BUDGETS) - 1) // (k + 1)))
  elif draft_name == "never":
    assert summary["total"]["accepted"] == 0 and summary["total"]["alpha_hat"] == 0.0
    np.testing.assert_array_equal(rounds, np.array(BUDGETS) - 1)  # one token per round
  elif draft_name == "perturbed":
    assert 0 < summary["total"]["accepted"] < summary["total"]["proposed"]


@pytest.mark.parametrize("k", [1, 8])
def test_early_stopping_keeps_greedy_output_and_stops_drafting(k):
  """Greedy with draft_stop_threshold 0.3 (confidence from the draft's softmax, not from its greedy
  point mass, which is always 1): the target's greedy output, fewer tokens proposed and fewer draft
  passes than K per round, and some rounds whose proposal was cut short."""
  out = run_speculative(DRAFTS["independent"], k=k, stop_threshold=0.3)
  assert as_token_lists(out.tokens, out.counts) == target_greedy()
  total = metrics.summarize(out.acceptance)["total"]
  rounds = int(np.asarray(out.acceptance.rounds).max())
  assert total["proposed"] < k * total["rounds"]
  if k > 1:
    assert int(out.draft_calls) < k * rounds


def test_greedy_with_a_restricted_draft_head_equals_target_greedy():
  """The target itself as the draft, scoring only the even ids: still the target's greedy output; it
  proposes only even tokens, so it is accepted exactly while the target's next token is even."""
  config, params = TARGET
  out = run_speculative(TARGET, k=3, draft_head=restrict_head(config, params, range(0, VOCAB, 2)))
  expected = target_greedy()
  assert as_token_lists(out.tokens, out.counts) == expected
  summary = metrics.summarize(out.acceptance)["total"]
  assert 0 < summary["accepted"] < summary["proposed"]
  odd_tokens = sum(t % 2 for row in expected for t in row[1:])  # each one ends a round's acceptance
  assert odd_tokens > 0


ONE_HOT = sampling_params(1.0, top_k=1)  # the argmax's one-hot distribution, through the sampled program


@pytest.mark.parametrize("draft_name", ["never", "perturbed", "independent"])
def test_greedy_on_ids_equals_the_rule_on_one_hot_distributions(draft_name):
  """Greedy rounds (target argmaxes compared with draft tokens, point-mass proposals) emit what the
  sampled program emits when every distribution is the one-hot argmax (top-k 1: drafts drawn from
  one-hot p, the generic rule on one-hot p and q), token for token, with the same acceptance counts;
  the greedy drafter proposes no distributions."""
  greedy = run_speculative(DRAFTS[draft_name], k=3)
  one_hot = run_speculative(DRAFTS[draft_name], k=3, sampling=ONE_HOT)
  assert as_token_lists(greedy.tokens, greedy.counts) == as_token_lists(one_hot.tokens, one_hot.counts)
  np.testing.assert_array_equal(greedy.acceptance.accepted_at, one_hot.acceptance.accepted_at)
  config, params = DRAFTS[draft_name]
  drafter = ModelDrafter(config, params)
  padded, lengths = pad_prompts(PROMPTS)
  state = jax.jit(ModelDrafter.init)(drafter, drafter.storage(3, CACHE_LEN), padded, lengths, None)
  for sampling, has_probs in ((GREEDY, False), (ONE_HOT, True)):
    proposal, _, _ = jax.jit(ModelDrafter.propose)(drafter, state, None, jnp.asarray([1, 2, 3]), sampling,
                                                   jax.random.key(0), RoundPlan(3))
    assert (proposal.probs is not None) == has_probs


def test_returned_caches_can_be_passed_again():
  first = run_speculative(DRAFTS["perturbed"], k=8)
  (target_config, target_params), drafter = TARGET, ModelDrafter(*DRAFTS["perturbed"])
  again = speculative_generate(SpeculativeLoop(target_config, 8, OUT_WIDTH), target_params, drafter,
                               testing.request(PROMPTS, BUDGETS), first.target_cache, first.draft_state.cache)
  np.testing.assert_array_equal(again.tokens, first.tokens)


@pytest.mark.parametrize("k, draft_names", [(1, ["never"]), (8, ["same", "never"])])
def test_caches_of_the_checked_size_are_filled_exactly(monkeypatch, k, draft_names):
  """With caches of exactly longest prompt + budget + K - 1 positions (the size the host check
  demands), some cache write ends at the last position and none beyond it (the cache would silently
  drop an overflowing write)."""
  write_ends = []
  unchecked_write = KVCache.write

  def checked_write(cache, layer, k_BxTxGxDh, v_BxTxGxDh):
    end = jnp.max(cache.lengths) + k_BxTxGxDh.shape[1] - cache.max_len
    jax.debug.callback(lambda e: write_ends.append(int(e)), end)
    return unchecked_write(cache, layer, k_BxTxGxDh, v_BxTxGxDh)

  monkeypatch.setattr(KVCache, "write", checked_write)
  size = max(map(len, PROMPTS)) + max(BUDGETS) + k - 1
  for name in draft_names:
    write_ends.clear()
    out = run_speculative(DRAFTS[name], k=k, target_cache_len=size, draft_cache_len=size)
    assert as_token_lists(out.tokens, out.counts) == target_greedy()
    assert max(write_ends) == 0


def test_greedy_with_a_different_architecture_and_cache_size():
  out = run_speculative(tiny_model(4, arch="gpt2", d_model=16), k=3, draft_cache_len=CACHE_LEN - 7)
  assert as_token_lists(out.tokens, out.counts) == target_greedy()


def test_eos_inside_an_accepted_block_stops_the_row_there():
  k = 8
  free = target_greedy()[0]
  # A token whose first occurrence in row 0 lies strictly inside a block of K + 1 (index 0 is the
  # prefill's token; with the identical draft, round r emits indices (K+1)(r-1)+1 .. (K+1)r).
  index = next(i for i in range(2, len(free)) if free.index(free[i]) == i and i % (k + 1) not in (0, 1))
  eos = [free[index]]
  out = run_speculative(DRAFTS["same"], eos_ids=eos, k=k)
  got = as_token_lists(out.tokens, out.counts)
  assert got == target_greedy(eos_ids=eos)
  assert got[0] == free[:index + 1]
  assert (np.asarray(out.tokens)[0, index + 1:] == 0).all()  # padded after the EOS


ALPHA = 1e-3


def _first_tokens(sampling, rule, draft_head=None):
  """Counts [V^3] of the first three tokens over N = SAMPLE_ROWS rows of one call, K = 2."""
  (target_config, target_params), drafter = SMALL_TARGET, ModelDrafter(*SMALL_DRAFT, draft_head)
  request = testing.request([SAMPLE_PROMPT] * SAMPLE_ROWS, SAMPLE_STEPS, sampling, seed=1)
  out = testing.speculate(SpeculativeLoop(target_config, 2, rule=rule), target_params, drafter, request,
                          cache_len=len(SAMPLE_PROMPT) + SAMPLE_STEPS + 2)
  index = np.ravel_multi_index(np.asarray(out.tokens).T, [target_config.vocab_size] * SAMPLE_STEPS)
  return np.bincount(index, minlength=target_config.vocab_size**SAMPLE_STEPS)


SAMPLINGS = {"plain": sampling_params(1.0)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_sampled_tokens_follow_the_exact_target_distribution(name):
  """Temperature 1: chi-square test at level 0.001 on N = SAMPLE_ROWS rows; the broken rule must fail the
  same test (p < 1e-12). Top-k and top-p on both models run in test_exactness (T = 0.7 and 1.5, K = 1
  and 2, bonus included, with broken rules and samplers)."""
  exact = exact_distribution(*SMALL_TARGET, SAMPLE_PROMPT, SAMPLINGS[name], SAMPLE_STEPS).ravel()
  assert chi_square_pvalue(_first_tokens(SAMPLINGS[name], verify), exact) > ALPHA
  assert chi_square_pvalue(_first_tokens(SAMPLINGS[name], accept_all), exact) < 1e-12


@pytest.mark.slow
def test_sampling_with_a_restricted_draft_head_follows_the_exact_target_distribution():
  """A draft that can propose only 5 of the 8 tokens: the residual supplies the other three with the
  target's probability. Chi-square at level 0.001 on N = SAMPLE_ROWS rows, temperature 1."""
  sampling = SAMPLINGS["plain"]
  head = restrict_head(*SMALL_DRAFT, [0, 2, 3, 5, 6])
  exact = exact_distribution(*SMALL_TARGET, SAMPLE_PROMPT, sampling, SAMPLE_STEPS).ravel()
  assert chi_square_pvalue(_first_tokens(sampling, verify, head), exact) > ALPHA


@pytest.mark.parametrize("stop_threshold", [0.0, 0.2])
def test_draft_cache_tracks_the_committed_history(stop_threshold):
  """Proposals after forced outcomes (all proposed tokens accepted, some, none, a row that commits
  nothing) use draft distributions equal to a full forward pass over [history, pending, d_1 .. d_{i-1}].
  With early stopping, each row proposes exactly its leading tokens whose distribution's top
  probability reaches the threshold, the first unconfident one drawn is not proposed, and the draft
  stops drawing once no row is drafting (here: proposals of 1, 2 and 3 passes, and rows accepting all
  K tokens, whose d_K is caught up in the next round)."""
  drafter, state, propose, commit, score = forced_draft_rounds(32, stop_threshold=stop_threshold)
  k, sampling = 3, sampling_params(1.0)
  history, pending, short_proposals, passes = [list(p) for p in FORCED_DRAFT_PROMPTS], [1, 2, 3], 0, set()
  schedule = [[4, 1, 2], [4, 4, 0], [0, 2, 4], [3, 4, 1], [1, 4, 4], [4, 4, 4], [2, 3, 4]]
  for round_, wanted in enumerate(schedule):
    proposal, state, _ = propose(drafter, state, None, jnp.asarray(pending), sampling, jax.random.key(round_),
                                 RoundPlan(k))
    tokens_BxK, probs_BxKxV, lengths_B = proposal.tokens, proposal.probs, np.asarray(proposal.lengths)
    drawn = int(proposal.calls)  # draft passes = tokens drawn
    passes.add(drawn)
    sequences_BxT = np.zeros((3, 32), np.int32)
    for b, row in enumerate(history):
      sequence = row + [pending[b]] + list(np.asarray(tokens_BxK[b]))
      sequences_BxT[b, :len(sequence)] = sequence
    want_BxTxV = np.asarray(score(jnp.asarray(sequences_BxT)))
    for b, row in enumerate(history):
      want_KxV = want_BxTxV[b, len(row):len(row) + drawn]
      np.testing.assert_allclose(probs_BxKxV[b, :drawn], want_KxV, atol=1e-5)
      top_K = want_KxV.max(axis=-1)
      assert (top_K[:lengths_B[b]] >= stop_threshold).all()
      assert lengths_B[b] == k or lengths_B[b] == drawn or top_K[lengths_B[b]] < stop_threshold
    short_proposals += int((lengths_B < k).sum())
    committed = np.minimum(wanted, lengths_B + 1) * (np.array(wanted) > 0)  # what a rule can commit
    state = commit(drafter, state, proposal, jnp.asarray(committed, jnp.int32), None)
    for b, c in enumerate(committed):
      if c:
        history[b] += ([pending[b]] + list(np.asarray(tokens_BxK[b])))[:c]
        pending[b] = (7 * round_ + b) % VOCAB  # whatever the target drew next
    np.testing.assert_array_equal(state.cache.lengths + state.lag, [len(row) for row in history])
  assert (short_proposals > 3) == (stop_threshold > 0)  # the threshold did stop some rows early
  assert passes == ({1, 2, 3} if stop_threshold else {3})


@pytest.mark.parametrize("change, message", [
    (dict(k=0), r"k \(draft tokens per round\) must be an integer >= 1"),
    (dict(k=8, budgets=[24, 6, 20],
          target_cache_len=39), r"\(target\).*9 tokens.*\+ look-ahead \(7\) = 40 positions exceed the cache size 39"),
    (dict(draft_cache_len=30), r"\(draft\).*= 31 positions exceed the cache size 30"),
    (dict(budgets=0), "max_new_tokens must be >= 1"),
    (dict(budgets=[25, 6, 20]), "exceeds out_width"),
    (dict(draft_head=restrict_head(*tiny_model(3, d_model=16), [1, 2])), "draft_head rows have width 16"),
])
def test_bad_inputs_fail_before_compiling(change, message):
  with pytest.raises(ValueError, match=message):
    run_speculative(**(dict(draft=DRAFTS["same"], k=3) | change))


class _SameFields(ModelDrafter):
  """A drafter class with its parent's fields (a researcher's variant, a test's mutant)."""


def test_a_drafter_subclass_with_the_same_fields_gets_a_program_of_its_own(monkeypatch):
  """Two drafter classes with the same fields flatten to pytree structures that jax compares equal
  (node data, not classes), so the class is part of the program's static settings: without it a
  mutant subclass once ran its parent's compiled program in a full run (its sampled counts equal, cell
  for cell, the correct drafter's). The static settings each call compiles for must differ."""
  config, params = SMALL_TARGET
  loops = []
  real = lowering.call_or_lower
  monkeypatch.setattr(lowering, "call_or_lower",
                      lambda f, lower, loop, *args: loops.append(loop) or real(f, lower, loop, *args))
  for drafter in (ModelDrafter(*SMALL_DRAFT), _SameFields(*SMALL_DRAFT)):
    testing.speculate(SpeculativeLoop(config, 2), params, drafter, testing.request([SAMPLE_PROMPT], 4),
                      cache_len=CACHE_LEN, lower=True)
  assert len(loops) == 2 and loops[0] != loops[1] and hash(loops[0]) != hash(loops[1])
