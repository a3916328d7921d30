"""The K policy (`specjax.speculative.k_policy`): its choice and estimates against a numpy reference,
greedy output unchanged for every drafter while the adaptive policy varies the proposal length (0
included), no draft pass beyond the chosen length, and the exactness of sampled output with the
policy on, next to a length choice that peeks at the target and fails the same test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import costs, decode_spec, testing
from specjax.api import apply_fields
from specjax.decode_config import default_config
from specjax.generation import as_token_lists
from specjax.sampling import sampling_params
from specjax.speculative import k_policy, loop
from specjax.speculative.drafters.eagle import EagleDrafter
from specjax.speculative.drafters.layer_skip import LayerSkipDrafter
from specjax.speculative.drafters.model import LAG_CHUNK, ModelDrafter
from specjax.speculative.drafters.ngram import NgramDrafter
from specjax.speculative.k_policy import Adaptive, Candidate, KPolicy, Tables
from specjax.speculative.loop import SpeculativeLoop
from specjax.speculative.plan import ChosenPlan
from specjax.speculative.trees import tree as tree_lib
from tests.helpers import ngram as ngram_setup
from tests.helpers.eagle import eagle_head, run_eagle
from tests.helpers.engine import (BUDGETS, CACHE_LEN, DRAFTS, TARGET, OUT_WIDTH, PROMPTS, SAMPLE_PROMPT, SAMPLE_STEPS,
                                  SMALL_DRAFT, SMALL_TARGET, first_tokens_pvalue, run_speculative, target_greedy,
                                  forced_draft_rounds, FORCED_DRAFT_PROMPTS)
from tests.helpers.k_policy import (COSTS_K3, POLICY, PeekingDrafter, assert_rounds_draft, tree_costs)
from tests.helpers.layer_skip import TARGET as TARGET_3, target_greedy_3
from tests.helpers.stats import SAMPLE_ROWS
from tests.helpers.trees import (LONG_STEPS, SAMPLED, STEPS, TREES, all_positions_pvalue, run_tree_speculative,
                                 sampled_pvalue)


def _reference_choice(alpha_BxAxK, live_B, cost_C, candidates, offered_B=None):
  """argmax over the candidates of sum over live rows of expected committed tokens / cost, each candidate
  priced by its own estimate (the whole cut's or the spine's). With `offered_B` (a lookup's lengths),
  row b reaches min(L, offered_b) tokens."""
  rates = []
  for candidate, cost in zip(candidates, cost_C):
    alpha_BxK = alpha_BxAxK[:, candidate.row]
    reach_B = [
        candidate.length if offered_B is None else min(candidate.length, int(o))
        for o in (offered_B if offered_B is not None else alpha_BxK)
    ]
    committed_B = 1 + np.array([sum(np.prod(alpha[:j + 1]) for j in range(n)) for alpha, n in zip(alpha_BxK, reach_B)])
    rates.append(committed_B[live_B].sum() / cost)
  return int(np.argmax(rates))


def _state(alpha_BxAxK, prior_AxK, num_candidates):
  return k_policy.PolicyState(alpha_BxAxK=jnp.asarray(alpha_BxAxK, jnp.float32),
                              prior_AxK=jnp.asarray(prior_AxK, jnp.float32), cost_C=jnp.ones(num_candidates),
                              chosen_C=jnp.zeros(num_candidates, jnp.int32), reached_AxK=jnp.zeros(np.shape(prior_AxK)),
                              accepted_AxK=jnp.zeros(np.shape(prior_AxK)), full=jnp.bool_(False))


def _wanted(choice):
  """(what each row may propose [B], the candidate's index) of a policy's choice (its plan, the index)."""
  plan, index = choice
  return plan.wanted_B, index


@pytest.mark.parametrize("offered", [False, True], ids=["drafted_after", "lookup_first"])
@pytest.mark.parametrize("tree", [None, tree_lib.from_branching((3, 2, 1, 1, 1, 1, 1, 1))], ids=["chain", "tree"])
def test_choose_maximises_expected_committed_tokens_per_second(tree, offered):
  """Against `_reference_choice`; `offered`: the drafter proposed first (a lookup, `free_proposal`),
  each row offering 0 .. K tokens."""
  rng = np.random.default_rng(0)
  k, policy = 8, Adaptive()
  candidates = policy.candidates(k, tree)
  assert policy.lengths(k) == (0, 1, 2, 3, 5, 8) and KPolicy().lengths(k) == (8,)
  rows = policy.rows(k, tree)
  assert rows == (1 if tree is None else 2) and len(candidates) == (6 if tree is None else 11)
  choose = jax.jit(lambda state, live_B, offered_B: _wanted(policy.choose(state, live_B, candidates, offered_B)))
  seen = set()
  for trial in range(200):
    alpha_BxAxK = rng.uniform(0.0, 1.0, (4, rows, k))**rng.uniform(0.1, 3.0)
    live_B = rng.uniform(size=4) < 0.7
    live_B[trial % 4] = True
    cost_C = np.sort(rng.uniform(0.5, 3.0, len(candidates))).astype(np.float32)
    state = _state(alpha_BxAxK, np.full((rows, k), 0.8), len(candidates)).replace(cost_C=jnp.asarray(cost_C))
    offered_B = rng.integers(0, k + 1, 4) if offered else None
    wanted_B, index = choose(state, jnp.asarray(live_B), None if offered_B is None else jnp.asarray(offered_B))
    want = _reference_choice(alpha_BxAxK, live_B, cost_C, candidates, offered_B)
    assert int(index) == want and (np.asarray(wanted_B) == candidates[want].length).all()
    seen.add(want)
  assert len(seen) >= 4  # the trials exercised most of the candidates
  if tree is not None:
    assert any(candidates[i].spine for i in seen) and any(not candidates[i].spine for i in seen)


def test_update_moves_reached_positions_and_recovers_the_others():
  """Toward each position's own prior (the runtime one, not the policy's constant), each estimate from
  its own observation; the counts a `Memory` learns are the reached and accepted positions summed."""
  policy, k = Adaptive(prior=0.6, decay=0.75, recovery=0.1), 4
  alpha_BxAxK = np.array([[[0.9, 0.5, 0.2, 0.7], [0.3, 0.4, 0.5, 0.6]]] * 4, np.float32)
  prior_AxK = np.array([[0.6, 0.5, 0.8, 0.3], [0.2, 0.9, 0.7, 0.4]], np.float32)
  proposed_AxB = np.array([[3, 3, 0, 4], [2, 0, 3, 4]])
  accepted_AxB = np.array([[1, 3, 0, 2], [1, 0, 3, 2]])
  live_B = np.array([True, True, True, False])
  got = policy.update(_state(alpha_BxAxK, prior_AxK, 5), jnp.int32(3), jnp.asarray(proposed_AxB),
                      jnp.asarray(accepted_AxB), jnp.asarray(live_B))
  want, reached, accepted = alpha_BxAxK.copy(), np.zeros((2, k)), np.zeros((2, k))
  for b, s, i in np.ndindex(4, 2, k):
    if live_B[b] and i <= accepted_AxB[s, b] and i < proposed_AxB[s, b]:
      want[b, s, i] = 0.75 * alpha_BxAxK[b, s, i] + 0.25 * (i < accepted_AxB[s, b])
      reached[s, i] += 1
      accepted[s, i] += i < accepted_AxB[s, b]
    else:
      want[b, s, i] = alpha_BxAxK[b, s, i] + 0.1 * (prior_AxK[s, i] - alpha_BxAxK[b, s, i])
  np.testing.assert_allclose(got.alpha_BxAxK, want, rtol=1e-6)
  np.testing.assert_array_equal(got.chosen_C, [0, 0, 0, 1, 0])
  np.testing.assert_array_equal(got.reached_AxK, reached)
  np.testing.assert_array_equal(got.accepted_AxK, accepted)


def test_the_spine_estimate_observes_the_accepted_paths_first_choice_prefix():
  """Nodes of TREES["paths"]: 1 [0], 2 [1], 3 [2], 4 [0, 0], 5 [0, 1], 6 [1, 0], 7 [0, 0, 0]."""
  path_BxDt1 = np.array([[0, 1, 4, 7], [0, 1, 5, 5], [0, 2, 6, 6], [0, 1, 4, 4], [0, 0, 0, 0], [0, 1, 1, 1]])
  accepted_B = np.array([3, 2, 2, 2, 0, 1])
  got = loop._spine_accepted(TREES["paths"], jnp.asarray(path_BxDt1), jnp.asarray(accepted_B))
  assert np.asarray(got).tolist() == [3, 1, 0, 2, 0, 1]


def _check_rounds(out, calls_per_round, tree=None, accepting=True):
  """Every round counted at its chosen candidate; the draft ran exactly `calls_per_round(L)` passes in a
  round of length (depth) L (none beyond what the policy wanted); the rounds drafted as chosen
  (`assert_rounds_draft`; `accepting`: the draft's tokens are accepted at all). Returns the candidates
  visited."""
  candidates = POLICY.candidates(3, tree)
  assert_rounds_draft(out, candidates, accepting)
  rounds_C = np.asarray(out.rounds_per_length)
  assert rounds_C.sum() == int(out.target_calls) - 1
  assert int(out.draft_calls) == sum(n * calls_per_round(c.length) for n, c in zip(rounds_C, candidates))
  return {c for n, c in zip(rounds_C, candidates) if n}


@pytest.mark.parametrize("draft_name", ["never", "perturbed"])
def test_model_drafter_keeps_greedy_output_while_the_length_varies(draft_name):
  """The catch-up pass always runs (it feeds the pending token), then one pass per further token."""
  out = run_speculative(DRAFTS[draft_name], k=3, policy=POLICY, tables=Tables(COSTS_K3))
  assert as_token_lists(out.tokens, out.counts) == target_greedy()
  visited = _check_rounds(out, lambda length: max(length, 1), accepting=draft_name != "never")
  assert len(visited) >= 2 and Candidate(0) in visited  # plain steps too (after rejections, before recovering)


def test_layer_skip_and_eagle_keep_greedy_output_while_the_length_varies():
  config, params = TARGET_3
  layer_skip = LayerSkipDrafter(config, params, (0,))
  out = testing.speculate(SpeculativeLoop(config, 3, OUT_WIDTH, policy=POLICY), params, layer_skip,
                          testing.request(PROMPTS, BUDGETS), cache_len=CACHE_LEN, tables=Tables(COSTS_K3))
  assert as_token_lists(out.tokens, out.counts) == target_greedy_3()
  assert len(_check_rounds(out, lambda length: length)) >= 2
  eagle = EagleDrafter(*eagle_head(config, (0, 2)), config, params)
  out = run_eagle(TARGET_3, eagle, 3, policy=POLICY, tables=Tables(COSTS_K3))
  assert as_token_lists(out.tokens, out.counts) == target_greedy_3()
  assert len(_check_rounds(out, lambda length: length, accepting=False)) >= 2  # a random head: nothing accepted


def _ngram_greedy(model_name, tree=None):
  """Greedy output of the n-gram drafter (K = 3, or spines of `tree`) with the policy on, checked against
  the target's own greedy tokens; returns the loop's output."""
  config, params = ngram_setup.MODELS[model_name]
  drafter = NgramDrafter(config.vocab_size, tree=tree)
  out = testing.speculate(SpeculativeLoop(config, 3, OUT_WIDTH, policy=POLICY), params, drafter,
                          testing.request(ngram_setup.PROMPTS, ngram_setup.BUDGETS), cache_len=48,
                          tables=Tables(COSTS_K3 if tree is None else tree_costs(tree)))
  free = ngram_setup.free_greedy(ngram_setup.MODELS[model_name])
  assert as_token_lists(out.tokens, out.counts) == [row[:n] for row, n in zip(free, ngram_setup.BUDGETS)]
  return out


def test_ngram_drafter_keeps_greedy_output_while_the_length_varies():
  assert len(_check_rounds(_ngram_greedy("cycling"), lambda length: 0)) >= 2


def test_calibration_verifies_a_lookups_forced_length_whole():
  """`Tables.full` (what `calibrate` runs): every round forced to L = 3 verifies 3 tokens per live row
  even where the lookup found fewer (so the table times the length-3 pass), greedy output unchanged,
  while the policy observes only the drafter's own tokens; without it the lookup's short offers stay
  short (the random model's text seldom repeats)."""
  config, params = ngram_setup.MODELS["random"]
  drafter = NgramDrafter(config.vocab_size)
  free = ngram_setup.free_greedy(ngram_setup.MODELS["random"])
  settings = SpeculativeLoop(config, 3, OUT_WIDTH, policy=POLICY)
  request = testing.request(ngram_setup.PROMPTS, ngram_setup.BUDGETS)
  outs = [
      testing.speculate(settings, params, drafter, request, cache_len=48,
                        tables=Tables(k_policy.forcing(4, 3), full=full)) for full in (True, False)
  ]
  for out in outs:
    assert as_token_lists(out.tokens, out.counts) == [row[:n] for row, n in zip(free, ngram_setup.BUDGETS)]
  full, short = outs
  rounds_B = np.asarray(full.acceptance.rounds)
  assert (np.asarray(full.acceptance.proposed) == 3 * rounds_B).all()
  assert np.asarray(short.acceptance.proposed).sum() < 3 * np.asarray(short.acceptance.rounds).sum()
  # The policy saw what the lookup offered, not the extension: as in the run without it.
  assert np.asarray(full.policy_reached).sum() == np.asarray(short.policy_reached).sum() < 3 * rounds_B.sum()


@pytest.mark.parametrize("draft_name, max_lag", [("never", 1), ("never", None), ("perturbed", None)])
def test_model_tree_keeps_greedy_output_while_the_depth_varies(draft_name, max_lag):
  """A static tree verified at the depth the policy chose (the tree cut there, `Tree.cut`): depth d
  costs d + 1 draft passes (the catch-up, whose last id is the root, then the cut's levels and its
  leaves), none beyond; depth 0 is a plain step, which runs no draft pass when the draft may lag
  (`max_lag` None; the prompt is the first lag) and the catch-up alone when it may not (1)."""
  tree = TREES["paths"]
  out = run_tree_speculative(DRAFTS[draft_name], tree, policy=POLICY, tables=Tables(tree_costs(tree)), max_lag=max_lag)
  assert as_token_lists(out.tokens, out.counts) == target_greedy()
  visited = _check_rounds(out, lambda depth: depth + 1 if depth or max_lag else 0, tree, draft_name != "never")
  assert len(visited) >= 3 and any(c.spine for c in visited) and any(c.length and not c.spine for c in visited)
  # What the estimates observed (a `Memory` learns it): the spine's in every drafting round, the whole
  # cut's in its own rounds only, never an acceptance its round did not reach.
  reached_AxK, accepted_AxK = np.asarray(out.policy_reached), np.asarray(out.policy_accepted)
  assert (accepted_AxK <= reached_AxK).all() and (reached_AxK[:, 0] > 0).all()
  assert reached_AxK[1, 0] > reached_AxK[0, 0]


def test_eagle_and_ngram_trees_keep_greedy_output_while_the_depth_varies():
  """EAGLE's tree costs d head passes at depth d (none for a plain step); n-gram spines cost none."""
  config, params = TARGET_3
  tree = tree_lib.from_branching((2, 2, 1))
  eagle = EagleDrafter(*eagle_head(config, (0, 2)), config, params, tree=tree)
  out = run_eagle(TARGET_3, eagle, 3, policy=POLICY, tables=Tables(tree_costs(tree)))
  assert as_token_lists(out.tokens, out.counts) == target_greedy_3()
  assert len(_check_rounds(out, lambda depth: depth, tree, accepting=False)) >= 2  # a random head
  spines = tree_lib.from_branching((2, 1, 1))
  assert len(_check_rounds(_ngram_greedy("cycling", spines), lambda depth: 0, spines)) >= 2


@pytest.mark.parametrize("fields, kind", [({}, "adaptive"), ({"tree": "(2,1)"}, "adaptive"),
                                          ({"tree": "dynamic(6,3,2)"}, "fixed"),
                                          ({"drafter": "ngram", "draft": ""}, "adaptive"),
                                          ({"k_policy": "fixed"}, "fixed"), ({"k_policy": "adaptive"}, "adaptive"),
                                          ({"k_policy": "adaptive", "tree": "(2,1)"}, "adaptive")])
def test_the_default_policy_adapts_a_chain_and_a_static_tree_and_keeps_a_dynamic_tree_fixed(fields, kind):
  """config.k_policy "auto" (the default) is adaptive for a chain and a static tree and fixed for a
  dynamic tree; the spec's config and the policy hold the kind that runs (the stats and stored cost
  tables say "adaptive", not "auto"), the drafter's settings whether its rounds may be plain."""
  cfg = default_config()
  assert cfg.k_policy == "auto"
  cfg.target, cfg.draft = "target-directory", "draft-directory"
  spec = decode_spec.from_config(apply_fields(cfg, fields))
  assert (spec.policy.kind, spec.config.k_policy) == (kind, kind)
  assert spec.drafter_settings.plain_rounds == (kind == "adaptive")


def test_fixed_policy_is_todays_loop():
  out = run_speculative(DRAFTS["perturbed"], k=3)
  assert np.asarray(out.rounds_per_length).tolist() == [int(out.target_calls) - 1]
  assert int(out.draft_calls) == 3 * (int(out.target_calls) - 1)


def test_a_forcing_cost_table_fixes_the_length():
  """What calibration relies on: `forcing` makes every round choose one length, and `round_limit`
  stops the loop after that many rounds."""
  for index, length in enumerate(POLICY.lengths(3)):
    out = run_speculative(DRAFTS["perturbed"], k=3, policy=POLICY, tables=Tables(k_policy.forcing(4, index)),
                          round_limit=2)
    assert np.asarray(out.rounds_per_length).tolist() == [2 if i == index else 0 for i in range(4)]


ALPHA = 1e-3


def _first_tokens(drafter, cost_C):
  """The first three tokens of N = SAMPLE_ROWS rows at T = 1, K = 2, the adaptive policy on."""
  (target_config, target_params), sampling = SMALL_TARGET, sampling_params(1.0)
  request = testing.request([SAMPLE_PROMPT] * SAMPLE_ROWS, SAMPLE_STEPS, sampling, seed=1)
  out = testing.speculate(SpeculativeLoop(target_config, 2, policy=POLICY), target_params, drafter, request,
                          cache_len=len(SAMPLE_PROMPT) + SAMPLE_STEPS + 2, tables=Tables(cost_C))
  return out.tokens, np.asarray(out.rounds_per_length), out


@pytest.mark.slow
def test_sampled_tokens_follow_the_exact_target_distribution_with_the_policy_on():
  """T = 1, K = 2, chi-square at level 0.001 on N = SAMPLE_ROWS rows of the first 3 tokens. Lengths vary with
  the draft's own draws (early stopping at a top probability of 0.5) and with the policy: the rows'
  first round proposes 2 tokens (at the prior, with costs (1, 1.2, 1.6)), their second 1 (the live rows
  are those that rejected d_1: their estimates fell).
  A drafter that shortens its proposal to 0 where the target would reject d_1, reading the target's
  distribution of the round being verified, must fail the same test (p < 1e-12)."""
  cost_C = np.array([1.0, 1.2, 1.6], np.float32)
  tokens, rounds_C, out = _first_tokens(ModelDrafter(*SMALL_DRAFT, stop_threshold=0.5), cost_C)
  assert (rounds_C[1:] > 0).all()  # both proposing lengths were chosen
  assert_rounds_draft(out, POLICY.candidates(2))
  assert first_tokens_pvalue(SMALL_TARGET, SAMPLE_PROMPT, sampling_params(1.0), tokens) > ALPHA
  peeking = PeekingDrafter(*SMALL_DRAFT, target_config=SMALL_TARGET[0], target_params=SMALL_TARGET[1])
  tokens, _, _ = _first_tokens(peeking, cost_C)
  assert first_tokens_pvalue(SMALL_TARGET, SAMPLE_PROMPT, sampling_params(1.0), tokens) < 1e-12


# Candidates 0, 1 spine, 1, 2 spine, 2, 3 spine, 3 of the tree (2, 2, 1): at the prior 0.8 the first round
# verifies the spine of depth 2; once the spine's estimate has dropped below the whole cut's (still at
# the prior), the cut of depth 2.
TREE_CHI2_COSTS = np.array([1.0, 1.2, 1.3, 1.5, 1.6, 10.0, 10.0], np.float32)


def _tree_tokens(rows=SAMPLE_ROWS):
  """The first LONG_STEPS tokens of N = `rows` rows of the model drafter drafting the tree (2, 2, 1) with
  the policy on (9 nodes of look-ahead), the draft lagging by its whole history (`lag_for`: the prompt is
  fed by the first round): the counts [V^STEPS] of the first STEPS, the [N, LONG_STEPS] tokens and the
  loop's output."""
  drafter = ModelDrafter(*SMALL_DRAFT, tree=TREES["branching"], max_lag=None)
  (config, params), cache_len = SMALL_TARGET, len(SAMPLE_PROMPT) + LONG_STEPS + 9
  out = testing.speculate(SpeculativeLoop(config, 3, policy=POLICY), params, drafter,
                          testing.request([SAMPLE_PROMPT] * rows, LONG_STEPS, SAMPLED, seed=2), cache_len=cache_len,
                          tables=Tables(TREE_CHI2_COSTS))
  tokens_ZxT = np.asarray(out.tokens)
  index = np.ravel_multi_index(tokens_ZxT[:, :STEPS].T, [config.vocab_size] * STEPS)
  return np.bincount(index, minlength=config.vocab_size**STEPS), tokens_ZxT, out


@pytest.mark.slow
def test_a_tree_cut_at_the_chosen_depth_follows_the_exact_target_distribution():
  """T = 0.8, top-k 6, the tree (2, 2, 1) cut at the policy's depth, whole or its spine alone, N = SAMPLE_ROWS
  rows of LONG_STEPS = 8 tokens (at least 3 rounds each, several at each of the candidates chosen):
  chi-square at level 0.001 of the first 3 tokens' joint, and every position's conditional given the
  row's earlier tokens (`all_positions_pvalue`: the randomized PIT per position, Bonferroni over the 8,
  level 0.001). The rows' first round verifies the spine of depth 2, later ones the whole cut of depth 2
  (`TREE_CHI2_COSTS`; depth 3 is never chosen): its leaves have children in the whole tree, which the
  cut must not try, and the spine's nodes are not a prefix of the tree's; the rounds drafted as chosen
  (`assert_rounds_draft`). Mutants, injected by `tests/helpers/mutant_plugin.py`, fail it:
  `shallow_tree_draft` (the drafter draws one level less than the loop verifies: the deepest level's
  tokens never drawn, probability 0 under the draft) and `deeper_tree_cut` (the loop verifies a level
  deeper than the round drafted; it passes the first 3 tokens' test, its tokens sitting at positions 3
  on, and the all-positions test rejects it)."""
  counts, tokens_ZxT, out = _tree_tokens()
  rounds_C = np.asarray(out.rounds_per_length)
  assert rounds_C[3] > 0 and rounds_C[4] > 0 and rounds_C[5:].sum() == 0
  assert_rounds_draft(out, POLICY.candidates(3, TREES["branching"]))
  assert (np.asarray(out.acceptance.rounds) >= 3).all()
  assert sampled_pvalue(counts) > ALPHA
  combined, pvalues_T = all_positions_pvalue(tokens_ZxT)
  assert combined > ALPHA, pvalues_T


def test_calibration_times_each_forced_length_after_warming_it(monkeypatch):
  """`calibrate` on a fake clock: a call costs 2 s of prefill (3 s for the first length's calls: a
  baseline that differs between lengths must not matter) plus each round's cost, the first round of
  each length 5 s more (a first execution); the table must be the per-round costs exactly."""
  round_s = np.array([0.3, 0.5, 0.6, 0.8], np.float32)
  clock, first_runs, calls = [0.0], set(), []

  def run(cost_C, round_limit):
    index = int(np.argmin(cost_C))  # the forced length
    calls.append((index, round_limit))
    clock[0] += (3.0 if index == 0 else 2.0) + round_limit * round_s[index]
    if round_limit and index not in first_runs:
      first_runs.add(index)
      clock[0] += 5.0
    return round_limit

  monkeypatch.setattr(k_policy.tuning.time, "perf_counter", lambda: clock[0])
  np.testing.assert_allclose(k_policy.calibrate(tuple(map(Candidate, range(4))), run, rounds=3), round_s, rtol=1e-5)
  # Per length: the untimed warm-up round, then 1 and 1 + 3 rounds timed.
  assert calls == [(index, limit) for index in range(4) for limit in (1, 1, 4)]


def test_calibration_times_enough_rounds_and_a_longer_proposal_never_costs_less(monkeypatch):
  """Rounds of 15-30 ms (a small model): 3 timed rounds last under MIN_TIMED_S, so the long call grows
  until they last it, or until the budget (40 rounds here) ends the call; length 1's measured dip below
  length 0 (noise: it does more work) is lifted to length 0's cost."""
  round_s = np.array([0.02, 0.015, 0.03])
  clock, calls = [0.0], []

  def run(cost_C, round_limit):
    index = int(np.argmin(cost_C))
    calls.append((index, round_limit))
    ran = min(round_limit, 40)
    clock[0] += 0.1 + ran * round_s[index]
    return ran

  monkeypatch.setattr(k_policy.tuning.time, "perf_counter", lambda: clock[0])
  np.testing.assert_allclose(k_policy.calibrate(tuple(map(Candidate, range(3))), run, rounds=3), [0.02, 0.02, 0.03],
                             rtol=1e-5)
  for index in range(3):
    limits = [limit for i, limit in calls if i == index]
    assert limits[:3] == [1, 1, 4] and len(limits) == 4  # one longer call sufficed (or hit the budget)
    assert (min(limits[3], 40) - 1) * round_s[index] >= k_policy.MIN_TIMED_S or limits[3] > 40


def test_a_round_is_priced_from_its_passes_and_one_overhead(monkeypatch):
  """`costs.candidate_passes` and `Prices`: a candidate of length L costs the target's pass over its L + 1
  tokens plus the drafter's own count of draft passes (`Drafter.passes`: L for a draft model, none for a
  lookup, none in a plain round), plus one measured overhead, made nondecreasing. The passes' timers are
  fakes (a T-token target pass 0.1 + 0.01 T s, a draft pass 0.03 s): a price that forgot the draft
  passes, charged a plain round one, or verified the wrong width fails here."""
  def fake_timer(config, params, T, batch_size, cache_len, offset, head, layers=None):
    seconds = 0.1 + 0.01 * T if params is None else 0.03  # the target's params: None here
    return lambda: seconds

  monkeypatch.setattr(costs, "forward_timer", fake_timer)
  candidates = tuple(map(Candidate, range(4)))
  model, lookup = ModelDrafter(*DRAFTS["perturbed"]), NgramDrafter(vocab_size=TARGET[0].vocab_size)
  passes_C = costs.candidate_passes(TARGET[0], None, model, candidates, 1, 64, 10, repeats=2)
  np.testing.assert_allclose(passes_C, [0.11, 0.12 + 0.03, 0.13 + 0.06, 0.14 + 0.09], rtol=1e-6)
  passes_C = costs.candidate_passes(TARGET[0], None, lookup, candidates, 1, 64, 10, repeats=2)
  np.testing.assert_allclose(passes_C, [0.11, 0.12, 0.13, 0.14], rtol=1e-6)
  prices = k_policy.Prices(np.array([0.10, 0.18, 0.17, 0.30]), overhead_s=0.02, prefill_s=1.0)
  np.testing.assert_allclose(prices.cost_C, [0.12, 0.20, 0.19, 0.32], rtol=1e-6)
  np.testing.assert_allclose(k_policy.monotone(candidates, prices.cost_C), [0.12, 0.20, 0.20, 0.32], rtol=1e-6)


def test_the_round_overhead_is_the_smaller_of_the_plain_and_the_longest_rounds_excess():
  """`Prices.measured`: passes 0.1 (plain) .. 0.3 (longest). Plain rounds timed at 0.12 and the longest at
  0.35 give 0.02 (the plain excess); a plain time inflated to 0.17 (a fresh process's first program) gives
  the longest's 0.05 instead; a longest round timed under its passes gives 0, never a negative price. The
  longest candidate's 1-round call less the prefill and a steady round is the first drafting round's
  catch-up: 1.6 - 1.0 - 0.35 = 0.25 (the plain 1-round call does not enter it), never negative."""
  passes_C = np.array([0.1, 0.2, 0.3])
  for plain_s, longest_s, overhead_s in [(0.12, 0.35, 0.02), (0.17, 0.35, 0.05), (0.17, 0.28, 0.0)]:
    plain, longest = k_policy.Forced(plain_s, 1.5), k_policy.Forced(longest_s, 1.6)
    prices = k_policy.Prices.measured(passes_C, plain, longest, prefill_s=1.0)
    assert prices.overhead_s == pytest.approx(overhead_s) and prices.forced_longest_s == longest_s
    assert prices.catch_up_s == pytest.approx(0.6 - longest_s)
    np.testing.assert_allclose(prices.cost_C, passes_C + overhead_s, rtol=1e-6)
  no_catch_up = k_policy.Prices.measured(passes_C, k_policy.Forced(0.12, 1.1), k_policy.Forced(0.35, 1.3), 1.0)
  assert no_catch_up.catch_up_s == 0.0


def test_the_cost_check_flags_a_table_that_misses_a_call_by_more_than_the_limit():
  """`Memory.check`: predicted = prefill + the rounds at their candidates' costs (here 0.5 + 10 x 0.1 +
  5 x 0.3 = 3.0 s), plus the first drafting round's catch-up (0.4 s) when a round drafted; a call 20% off
  keeps the table, 30% off (either way) marks it stale, and calls predicted under MIN_CHECKED_S are not
  judged."""
  def memory():
    return k_policy.Memory(0.8, 3, cost_C=np.array([0.1, 0.2, 0.3], np.float32), prefill_s=0.5, catch_up_s=0.4)

  for measured, stale in ((4.08, False), (2.72, False), (4.42, True), (2.38, True)):
    m = memory()
    check = m.check(np.array([10, 0, 5]), measured, drafted=True)
    assert check["predicted_s"] == pytest.approx(3.4) and check["stale"] == stale == m.stale, (measured, check)
  plain = memory().check(np.array([30, 0, 0]), 3.0, drafted=False)  # no drafting round: no catch-up
  assert plain["predicted_s"] == pytest.approx(3.5) and not plain["stale"]
  assert memory().check(np.array([1, 0, 0]), 100.0, drafted=False) is None  # 0.1 s of rounds: too short to judge


# (tokens the policy wants, what each row commits, draft passes the round must run: bounded lag of 3, the
# whole history as the lag)
LAG_SCHEDULE = [(2, [3, 1, 2], 2, 2), (0, [1, 1, 1], 0, 0), (0, [1, 1, 0], 0, 0), (0, [1, 1, 1], 1, 0),
                (0, [1, 1, 1], 0, 0), (3, [4, 2, 0], 3, 3), (1, [2, 1, 2], 1, 1), (0, [1, 1, 1], 0, 0),
                (3, [1, 4, 3], 3, 3)]
# The whole history: 36 plain rounds, then a drafting round whose catch-up takes two passes (37 or more
# ids: LAG_CHUNK is 32), then a plain and a drafting round.
HISTORY_SCHEDULE = ([(0, [1, 1, 1], 0, 0)] * 36 + [(2, [3, 1, 2], 0, 3), (0, [1, 1, 1], 0, 0), (3, [4, 2, 0], 0, 3)])


@pytest.mark.parametrize("max_lag", [3, None])
def test_plain_rounds_skip_the_draft_and_its_lag_is_fed_when_drafting_resumes(max_lag):
  """A round whose policy wants no token runs no draft pass (0 calls, nothing proposed) while every
  row's lag has room for its pending token; with `max_lag` 3, the round whose pending token would
  overflow some row's lag feeds them all (1 call), and so does the next drafting round. With the whole
  history as its lag (None) the draft starts empty: the prompts wait in the lag for the first drafting
  round, and a long plain stretch is fed in passes of LAG_CHUNK ids. Forced outcomes (full, partial, no
  acceptance, a row that commits nothing) between: the cache plus the lag always hold each row's
  history, and every drafting round's distributions equal a full forward pass over [history, pending,
  d_1 .. d_{i-1}] (a lag fed in the wrong order, dropped, doubled or cut at a chunk's edge fails)."""
  cache_len = 40 if max_lag else 64
  drafter, state, propose, commit, score = forced_draft_rounds(cache_len, max_lag=max_lag)
  k, sampling, config = 3, sampling_params(1.0), drafter.config
  history, pending = [list(p) for p in FORCED_DRAFT_PROMPTS], [1, 2, 3]
  assert np.asarray(state.cache.lengths).tolist() == ([len(p) for p in history] if max_lag else [0, 0, 0])
  for round_, (wanted, committed, *calls) in enumerate(LAG_SCHEDULE if max_lag else HISTORY_SCHEDULE):
    proposal, state, _ = propose(drafter, state, None, jnp.asarray(pending), sampling, jax.random.key(round_),
                                 ChosenPlan(k, jnp.full((3,), wanted, jnp.int32)))
    assert int(proposal.calls) == calls[0 if max_lag else 1]
    assert np.asarray(proposal.lengths).tolist() == [wanted] * 3
    sequences_BxT = np.zeros((3, cache_len), np.int32)
    for b, row in enumerate(history):
      sequence = row + [pending[b]] + list(np.asarray(proposal.tokens[b]))
      sequences_BxT[b, :len(sequence)] = sequence
    want_BxTxV = np.asarray(score(jnp.asarray(sequences_BxT)))
    for b, row in enumerate(history):
      np.testing.assert_allclose(proposal.probs[b, :wanted], want_BxTxV[b, len(row):len(row) + wanted], atol=1e-5)
    state = commit(drafter, state, proposal, jnp.asarray(committed, jnp.int32), None)
    for b, c in enumerate(committed):
      if c:
        history[b] += ([pending[b]] + list(np.asarray(proposal.tokens[b])))[:c]
        pending[b] = (7 * round_ + b) % config.vocab_size
    np.testing.assert_array_equal(state.cache.lengths + state.lag, [len(row) for row in history])
  assert int(jnp.max(state.lag)) <= (3 if max_lag else 1)


@pytest.mark.parametrize("max_lag", [3, None])
def test_a_tree_drafter_defers_plain_rounds_and_feeds_its_lag_when_drafting_resumes(max_lag):
  """The schedules above with the tree (2, 2, 1): a round of depth d runs the catch-up passes and d
  more (the tree feeds its leaves, so no accepted token lags), a plain round none unless some row's
  pending token would overflow its lag (then the catch-up alone), and every drafting round's root and
  level-2 distributions equal a full forward pass over [history, pending] and [history, pending, node 1].
  Row b commits the branch under the root's child b mod 2 (first children below), down to the depth
  the schedule commits; every other drafting round (the first too) verifies only the spine (nodes 1, 3, 7): the
  drafter draws nothing else (zeros elsewhere) and every row commits along it, whose keys the draft
  cache holds in consecutive slots (a compaction by tree slots would corrupt the next round's
  distributions)."""
  tree = TREES["branching"]
  cache_len = 40 if max_lag else 64
  drafter, state, propose, commit, score = forced_draft_rounds(cache_len, max_lag=max_lag, tree=tree)
  sampling, config, paths = sampling_params(1.0), drafter.config, tree.path_table()
  history, pending = [list(p) for p in FORCED_DRAFT_PROMPTS], [1, 2, 3]
  lag = [0] * 3 if max_lag else [len(p) for p in history]  # what the draft cache lacks, modelled
  drafting_rounds = 0
  for round_, (wanted, committed, *_) in enumerate(LAG_SCHEDULE if max_lag else HISTORY_SCHEDULE):
    spine = wanted > 0 and drafting_rounds % 2 == 0  # a whole cut's round follows each spine's
    drafting_rounds += wanted > 0
    proposal, state, _ = propose(drafter, state, None, jnp.asarray(pending), sampling, jax.random.key(round_),
                                 ChosenPlan(3, jnp.full((3,), wanted, jnp.int32), jnp.bool_(spine)))
    deferred = wanted == 0 and max(lag) + 1 <= (max_lag or cache_len)
    catch_up = 0 if deferred else -(-(max(lag) + 1) // min((max_lag or cache_len) + 1, LAG_CHUNK))
    assert int(proposal.calls) == catch_up + wanted
    lag = [(n + 1 if deferred else 0) if c else n for n, c in zip(lag, committed)]
    tokens_BxN1 = np.pad(np.asarray(proposal.tokens), ((0, 0), (1, 0)))
    sequences_BxT = np.zeros((3, cache_len), np.int32)
    for b, row in enumerate(history):
      sequence = row + [pending[b], tokens_BxN1[b, 1]]
      sequences_BxT[b, :len(sequence)] = sequence
    want_BxTxV = np.asarray(score(jnp.asarray(sequences_BxT)))
    for b, row in enumerate(history):
      for node, offset in ((1, 0), (3, 1))[:wanted]:  # node 1 (the root's child), node 3 (node 1's)
        np.testing.assert_allclose(proposal.probs[b, node - 1], want_BxTxV[b, len(row) + offset], atol=1e-5)
    if spine:
      off_spine = [node - 1 for node in range(1, tree.nodes_with_root) if node not in tree.spine()]
      assert not np.asarray(proposal.tokens)[:, off_spine].any() and not np.asarray(proposal.probs)[:, off_spine].any()
    branch = [0] * 3 if spine else [b % 2 for b in range(3)]
    nodes = [[0, 1 + branch[b], 3 + 2 * branch[b], 7 + 2 * branch[b]][max(c - 1, 0)] for b, c in enumerate(committed)]
    path_BxDt1 = jnp.asarray(paths[nodes])
    state = commit(drafter, state, proposal.along(path_BxDt1), jnp.asarray(committed, jnp.int32), None)
    for b, c in enumerate(committed):
      if c:
        history[b] += [pending[b]] + [int(tokens_BxN1[b, node]) for node in paths[nodes[b]][1:c]]
        pending[b] = (7 * round_ + b) % config.vocab_size
    np.testing.assert_array_equal(state.cache.lengths + state.lag, [len(row) for row in history])
    np.testing.assert_array_equal(state.lag, lag)


@pytest.mark.parametrize("max_lag", [2, 5, None])
def test_a_deferring_model_drafter_keeps_greedy_output(max_lag):
  """The loop with plain rounds that skip the draft: greedy output unchanged, and fewer draft passes
  than the drafter that feeds every pending token (max_lag 1) on the same rounds."""
  feeding = run_speculative(DRAFTS["perturbed"], k=3, policy=POLICY, tables=Tables(COSTS_K3))
  out = run_speculative(DRAFTS["perturbed"], k=3, policy=POLICY, tables=Tables(COSTS_K3), max_lag=max_lag)
  assert as_token_lists(out.tokens, out.counts) == target_greedy()
  assert np.asarray(out.rounds_per_length).tolist() == np.asarray(feeding.rounds_per_length).tolist()
  assert np.asarray(out.rounds_per_length)[0] > 0 and int(out.draft_calls) < int(feeding.draft_calls)


def test_a_call_that_never_drafts_never_runs_the_draft():
  """With the whole history as the lag and a prior under which no length pays, every round is plain:
  greedy output unchanged, no draft pass, and the draft's cache still empty at the end (its prompt was
  never prefilled)."""
  out = run_speculative(DRAFTS["perturbed"], k=3, policy=POLICY, tables=Tables(COSTS_K3, np.full(3, 0.05)),
                        max_lag=None)
  assert as_token_lists(out.tokens, out.counts) == target_greedy()
  assert np.asarray(out.rounds_per_length)[1:].sum() == 0 and int(out.draft_calls) == 0
  assert np.asarray(out.draft_state.cache.lengths).tolist() == [0] * len(PROMPTS)


def test_memory_pools_each_calls_acceptance_into_the_next_prior():
  """Each position's prior is its observed rate shrunk toward the position before it (the first: toward
  the constant), so a position no round reached inherits its predecessor's, not the constant's; later
  calls add up, and a position keeps at most MEMORY_ROUNDS observations."""
  memory = k_policy.Memory(0.8, 3, rows=2)  # row 1 (a spine's estimate) learns only what it is given
  np.testing.assert_allclose(memory.prior_AxK, np.full((2, 3), 0.8))
  memory.learn(np.array([[40, 8, 0], [0, 0, 0]]), np.array([[10, 8, 0], [0, 0, 0]]))
  first = (6.4 + 10) / 48
  second = (8 * first + 8) / 16
  np.testing.assert_allclose(memory.prior_AxK, [[first, second, second], [0.8, 0.8, 0.8]], rtol=1e-6)
  memory.learn(np.array([[40, 8, 0], [8, 0, 0]]), np.array([[30, 0, 0], [0, 0, 0]]))
  first = (6.4 + 40) / 88
  np.testing.assert_allclose(memory.prior_AxK[0], [first, (8 * first + 8) / 24, (8 * first + 8) / 24], rtol=1e-6)
  np.testing.assert_allclose(memory.prior_AxK[1], [0.4] * 3, rtol=1e-6)
  memory.learn(np.array([[1000, 0, 0], [0, 0, 0]]), np.array([[1000, 0, 0], [0, 0, 0]]))
  assert memory.reached_AxK[0, 0] == k_policy.MEMORY_ROUNDS  # the 1080 rounds seen, scaled to 256
  np.testing.assert_allclose(memory.prior_AxK[0, 0], (6.4 + 256 * 1040 / 1080) / (8 + 256), rtol=1e-6)
  always = k_policy.Memory(0.8, 1)
  always.learn(np.array([[10_000]]), np.array([[10_000]]))
  assert always.prior_AxK[0, 0] == np.float32(0.99)  # never taken for granted


def test_a_prior_sets_the_first_rounds_choice():
  """The same program, two runtime priors: at 0.95 the first round proposes K = 3, at 0.3 nothing."""
  rounds = {}
  for prior in (0.95, 0.3):
    out = run_speculative(DRAFTS["perturbed"], k=3, policy=POLICY, tables=Tables(COSTS_K3, np.full(3, prior)),
                          round_limit=1)
    rounds[prior] = np.asarray(out.rounds_per_length).tolist()
  assert rounds == {0.95: [0, 0, 0, 1], 0.3: [1, 0, 0, 0]}
