"""The n-gram (prompt lookup) drafter: its proposals against a plain-Python statement of the rule, its
history bookkeeping, and the engine driven by it.

Unit: `propose` on hand-made contexts in one ragged batch (the longest n-gram wins, no match proposes
nothing, a continuation cut at the context's end, the earliest occurrence, overlapping self-matches,
ngram_min = ngram_max = 1 and ngram_min = 2) and on random contexts over a 3-token vocabulary, all
equal to `_reference_proposal`; `commit` appends exactly [pending, d_1 .. d_n] over several rounds
and drops writes past the end instead of clamping them onto the history.
Greedy: the output equals the target's own greedy decoding for ragged prompts, per-row budgets, an EOS
inside an accepted block, K = 1 and 8, with the random target of `helpers.engine` and a near-bigram
variant whose greedy output falls into runs; a plain-Python replay of the loop (`_replay`) predicts
every row's rounds, proposed and accepted counts and which rounds run the single-token verify pass.
Sampling: the first three tokens over SAMPLE_ROWS rows follow the target's exact distribution at
temperature 0.7 with top-k and at 1.0 (chi-square, level 0.001), and a rule that accepts every
proposed token fails the same test.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import testing
from specjax.generation import as_token_lists, pad_prompts
from specjax.models.kv_cache import init_cache
from specjax.sampling import sampling_params
from specjax.speculative import verify, verify_greedy
from specjax.speculative.drafters.ngram import NgramDrafter
from specjax.speculative.loop import SpeculativeLoop, speculative_generate
from specjax.speculative.plan import RoundPlan
from tests.helpers.engine import (CACHE_LEN, GREEDY, NO_EOS, OUT_WIDTH, SMALL_TARGET, TARGET, VOCAB,
                                  accept_all_proposed, exact_distribution)
from tests.helpers.ngram import BUDGETS, HISTORY_LEN, MODELS, PROMPTS, SAMPLE_PROMPT, free_greedy
from tests.helpers.stats import SAMPLE_ROWS, chi_square_pvalue


def _reference_proposal(context, ngram_min, ngram_max, k):
  """The rule in plain Python: for the longest n in [ngram_max .. ngram_min] whose last n tokens also
  end at an earlier position j <= L - 2, the up to k tokens after the earliest such j."""
  length = len(context)
  for n in range(ngram_max, ngram_min - 1, -1):
    for j in range(n - 1, length - 1):
      if context[j - n + 1:j + 1] == context[length - n:]:
        return context[j + 1:j + 1 + k]
  return []


_propose = jax.jit(NgramDrafter.propose)
_commit = jax.jit(NgramDrafter.commit)
_init = jax.jit(NgramDrafter.init)


def _proposals(drafter, contexts, k, max_len=16):
  """The drafter's proposals (as token lists) for contexts = history + [pending], one per row."""
  padded, lengths = pad_prompts([context[:-1] for context in contexts])
  state = _init(drafter, drafter.storage(len(contexts), max_len), padded, lengths, None)
  pending = jnp.asarray([context[-1] for context in contexts], jnp.int32)
  proposal, _, _ = _propose(drafter, state, None, pending, GREEDY, jax.random.key(0), RoundPlan(k))
  tokens, lengths = np.asarray(proposal.tokens), np.asarray(proposal.lengths)
  return [list(map(int, row[:n])) for row, n in zip(tokens, lengths)]


HAND_MADE = {  # context (history + pending) -> proposal with K = 4, ngram_min = 1, ngram_max = 3
    "longest_wins": ([7, 2, 3, 4, 1, 2, 3, 5, 9, 1, 2, 3], [5, 9, 1, 2]),  # "1 2 3", not "2 3" or "3"
    "no_match": ([1, 2, 3, 4, 5], []),
    "cut_at_context_end": ([4, 5, 6, 4, 5], [6, 4, 5]),  # only 3 tokens follow "4 5"
    "earliest_occurrence": ([1, 5, 1, 6, 1, 7, 1], [5, 1, 6, 1]),  # the latest would give [7, 1]
    "overlapping_self_match": ([7, 7, 7, 7], [7]),  # "7 7 7" ends at index 2, followed by one 7
    "shortest_context": ([5, 5], [5]),
    "pending_only_match": ([9, 8], []),
}
OTHER_SIZES = {  # (ngram_min, ngram_max) -> expected proposal per HAND_MADE row
    (1, 2): {"longest_wins": [4, 1, 2, 3], "overlapping_self_match": [7, 7]},  # "2 3" first ends at 2
    (1, 1): {"longest_wins": [4, 1, 2, 3], "overlapping_self_match": [7, 7, 7]},
    (2, 3): {"earliest_occurrence": [], "shortest_context": [], "cut_at_context_end": [6, 4, 5]},
}


def test_propose_on_hand_made_contexts():
  names = sorted(HAND_MADE)
  contexts = [HAND_MADE[name][0] for name in names]
  got = dict(zip(names, _proposals(NgramDrafter(VOCAB, 1, 3), contexts, k=4)))
  for name in names:
    assert got[name] == HAND_MADE[name][1] == _reference_proposal(HAND_MADE[name][0], 1, 3, 4), name
  for (ngram_min, ngram_max), expected in OTHER_SIZES.items():
    got = dict(zip(names, _proposals(NgramDrafter(VOCAB, ngram_min, ngram_max), contexts, k=4)))
    for name in names:
      want = _reference_proposal(HAND_MADE[name][0], ngram_min, ngram_max, 4)
      assert got[name] == want, (ngram_min, ngram_max, name)
      if name in expected:
        assert want == expected[name], (ngram_min, ngram_max, name)


@pytest.mark.parametrize("ngram_min, ngram_max", [(1, 1), (1, 3), (2, 4)])
def test_propose_matches_the_reference_on_random_contexts(ngram_min, ngram_max):
  """64 contexts of 2 to 16 tokens over 3 token ids (matches of every size, overlapping ones, cut
  continuations and misses), K = 5."""
  rng = np.random.default_rng(ngram_min * 10 + ngram_max)
  contexts = [list(map(int, rng.integers(0, 3, rng.integers(2, 17)))) for _ in range(64)]
  got = _proposals(NgramDrafter(VOCAB, ngram_min, ngram_max), contexts, k=5, max_len=17)
  want = [_reference_proposal(context, ngram_min, ngram_max, 5) for context in contexts]
  assert got == want
  assert {len(w) for w in want} >= {0, 1, 5}


def test_commit_appends_pending_and_the_committed_drafts():
  """Five rounds of propose/commit with forced outcomes (nothing, pending only, some, all K + 1);
  each round's proposals equal the reference on the history so far, and the history equals the
  Python one, zeros past each row's length (whatever the storage held before `init`)."""
  drafter, k, max_len = NgramDrafter(VOCAB, 1, 2), 3, 32
  prompts = [[1, 2, 1, 3], [4, 4], [2, 5, 2, 5, 2]]
  padded, lengths = pad_prompts(prompts)
  storage = drafter.storage(3, max_len)
  storage = storage.replace(history=storage.history + 9, lengths=storage.lengths + 5)  # stale contents
  state = _init(drafter, storage, padded, lengths, None)
  history, rng = [list(p) for p in prompts], np.random.default_rng(0)
  for round_, committed in enumerate([[4, 1, 0], [2, 0, 4], [0, 4, 3], [1, 2, 4], [4, 4, 1]]):
    pending = [int(t) for t in rng.integers(1, 6, 3)]
    proposal, state, _ = _propose(drafter, state, None, jnp.asarray(pending, jnp.int32), GREEDY, jax.random.key(round_),
                                  RoundPlan(k))
    tokens, lengths = np.asarray(proposal.tokens), np.asarray(proposal.lengths)
    for b, row in enumerate(history):
      assert list(tokens[b, :lengths[b]]) == _reference_proposal(row + [pending[b]], 1, 2, k), (round_, b)
    state = _commit(drafter, state, proposal, jnp.asarray(committed, jnp.int32), None)
    for b, c in enumerate(committed):
      history[b] += ([pending[b]] + list(map(int, tokens[b])))[:c]
    want = np.zeros((3, max_len), np.int32)
    for b, row in enumerate(history):
      want[b, :len(row)] = row
    np.testing.assert_array_equal(state.history, want)
    np.testing.assert_array_equal(state.lengths, [len(row) for row in history])


def test_commit_drops_writes_past_the_end():
  """A row 2 positions from the end committing 4 tokens keeps its history and gets the first two
  (a clamped write would shift the block back over committed tokens)."""
  drafter, max_len = NgramDrafter(VOCAB, 1, 2), 8
  padded, lengths = pad_prompts([[1, 2, 3, 4, 5, 6], [7]])
  state = _init(drafter, drafter.storage(2, max_len), padded, lengths, None)
  proposal, state, _ = _propose(drafter, state, None, jnp.asarray([10, 11], jnp.int32), GREEDY, jax.random.key(0),
                                RoundPlan(3))
  proposal = proposal.replace(tokens=jnp.asarray([[20, 21, 22], [30, 31, 32]], jnp.int32))
  state = _commit(drafter, state, proposal, jnp.asarray([4, 4], jnp.int32), None)
  np.testing.assert_array_equal(state.history, [[1, 2, 3, 4, 5, 6, 10, 20], [7, 11, 30, 31, 32, 0, 0, 0]])


# --- The engine, greedy ---------------------------------------------------------------------------

DRAFTER = NgramDrafter(VOCAB, ngram_min=1, ngram_max=3)
_verify_widths = []  # the width - 1 of every verify pass that ran, appended by `_recording_verify_greedy`


def _recording_verify_greedy(proposal, target_tokens_BxK1):
  """`verify_greedy`, recording the (static) number of draft slots of each verify pass that actually
  runs."""
  width = proposal.k
  jax.debug.callback(lambda: _verify_widths.append(width))
  return verify_greedy(proposal, target_tokens_BxK1)


def _replay(prompt, free, budget, eos_ids, k):
  """The loop in plain Python for one greedy row: each round proposes `_reference_proposal` of the
  context prompt + emitted tokens, accepts the drafts equal to the target's greedy tokens, and emits
  them and the next one, cut at EOS and budget. Returns the emitted tokens, per-round proposal
  lengths and accepted counts."""
  emitted, lengths, accepted = [free[0]], [], []
  done = budget <= 1 or free[0] in eos_ids
  while not done:
    c = len(emitted)
    proposal = _reference_proposal(prompt + free[:c], DRAFTER.ngram_min, DRAFTER.ngram_max, k)
    n = 0
    while n < len(proposal) and proposal[n] == free[c + n]:
      n += 1
    lengths.append(len(proposal))
    accepted.append(n)
    for token in free[c:c + n + 1]:
      emitted.append(token)
      if token in eos_ids or len(emitted) >= budget:
        done = True
        break
  return emitted, lengths, accepted


def _ngram_generate(model, k, eos_ids=NO_EOS):
  (config, params), batch = model, len(PROMPTS)
  _verify_widths.clear()
  out = speculative_generate(SpeculativeLoop(config, k, OUT_WIDTH, greedy_rule=_recording_verify_greedy), params,
                             DRAFTER, testing.request(PROMPTS, BUDGETS, eos_ids=eos_ids),
                             init_cache(config, batch, CACHE_LEN), DRAFTER.storage(batch, HISTORY_LEN))
  jax.effects_barrier()
  return out


def _check_against_replay(out, replays, k):
  """Tokens, per-row acceptance counts and the verify widths the loop ran, all as the replay says."""
  assert as_token_lists(out.tokens, out.counts) == [emitted for emitted, _, _ in replays]
  np.testing.assert_array_equal(out.acceptance.rounds, [len(lengths) for _, lengths, _ in replays])
  np.testing.assert_array_equal(out.acceptance.proposed, [sum(lengths) for _, lengths, _ in replays])
  np.testing.assert_array_equal(out.acceptance.accepted, [sum(accepted) for _, _, accepted in replays])
  rounds = max(len(lengths) for _, lengths, _ in replays)
  assert int(out.target_calls) == rounds + 1 and int(out.draft_calls) == 0
  # A round runs the single-token pass exactly when no live row proposes anything.
  narrow = sum(all(lengths[r] == 0 for _, lengths, _ in replays if r < len(lengths)) for r in range(rounds))
  assert collections.Counter(_verify_widths) == collections.Counter({0: narrow, k: rounds - narrow})
  return narrow


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_greedy_equals_target_greedy(model_name, k):
  free = free_greedy(MODELS[model_name])
  replays = [_replay(p, f, b, NO_EOS, k) for p, f, b in zip(PROMPTS, free, BUDGETS)]
  assert [emitted for emitted, _, _ in replays] == [f[:b] for f, b in zip(free, BUDGETS)]
  out = _ngram_generate(MODELS[model_name], k)
  narrow = _check_against_replay(out, replays, k)
  proposed, accepted = int(out.acceptance.proposed.sum()), int(out.acceptance.accepted.sum())
  assert proposed < k * int(out.acceptance.rounds.sum())  # some rows found no match
  if model_name == "random":  # rounds in which no live row found any: the single-token pass ran
    assert narrow > 0
  if model_name == "cycling":  # its cycle is predicted, a whole block of 8 at a time
    assert accepted >= 10 and int(out.acceptance.accepted_at[:, -1].sum()) > 0
  assert 0 < proposed and accepted < proposed


def test_eos_inside_an_accepted_block_stops_the_row_there():
  """Row 0's prompt holds the cycling target's cycle, so its first round accepts drafts copied from
  the prompt; one of them, emitted for the first time, is made the EOS."""
  k, model = 8, MODELS["cycling"]
  free = free_greedy(model)
  _, _, accepted = _replay(PROMPTS[0], free[0], BUDGETS[0], NO_EOS, k)
  # Round r emits indices c_r .. c_r + n_r of the row's output, c_r .. c_r + n_r - 1 being accepted
  # drafts: the first of them that is a token's first occurrence.
  starts = np.cumsum([1] + [n + 1 for n in accepted])
  index = next(
      i for r, n in enumerate(accepted) for i in range(starts[r], starts[r] + n) if free[0].index(free[0][i]) == i)
  eos = [free[0][index]]
  replays = [_replay(p, f, b, eos, k) for p, f, b in zip(PROMPTS, free, BUDGETS)]
  assert replays[0][0] == free[0][:index + 1]
  out = _ngram_generate(model, k, eos_ids=eos)
  _check_against_replay(out, replays, k)
  assert (np.asarray(out.tokens)[0, index + 1:] == 0).all()  # padded after the EOS


# --- The engine, sampling -------------------------------------------------------------------------

SAMPLE_STEPS, ALPHA = 3, 1e-3


def _first_tokens(sampling, rule):
  """Counts [V^3] of the first three tokens over N = SAMPLE_ROWS rows of one call, K = 2, and the
  acceptance counters."""
  (config, params), drafter = SMALL_TARGET, NgramDrafter(SMALL_TARGET[0].vocab_size, 1, 3)
  request = testing.request([SAMPLE_PROMPT] * SAMPLE_ROWS, SAMPLE_STEPS, sampling, seed=1)
  out = testing.speculate(SpeculativeLoop(config, 2, rule=rule), params, drafter, request,
                          cache_len=len(SAMPLE_PROMPT) + SAMPLE_STEPS + 1)
  index = np.ravel_multi_index(np.asarray(out.tokens).T, [config.vocab_size] * SAMPLE_STEPS)
  return np.bincount(index, minlength=config.vocab_size**SAMPLE_STEPS), out.acceptance


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [sampling_params(0.7, top_k=3)], ids=["t0.7_top_k3"])
def test_sampled_tokens_follow_the_exact_target_distribution(sampling):
  """Chi-square at level 0.001 on N = SAMPLE_ROWS rows; the broken rule must fail it (p < 1e-12). Every
  row proposes in its first round, and a good share of the drafts is accepted. (Point masses carry no
  draft temperature: T = 1 is the same code with other numbers; the model drafter's T = 1 runs in
  test_speculative.)"""
  exact = exact_distribution(*SMALL_TARGET, SAMPLE_PROMPT, sampling, SAMPLE_STEPS).ravel()
  counts, acceptance = _first_tokens(sampling, verify)
  assert chi_square_pvalue(counts, exact) > ALPHA
  proposed, accepted = np.asarray(acceptance.proposed), np.asarray(acceptance.accepted)
  assert (proposed > 0).all() and (accepted > 0).mean() > 0.2
  broken, _ = _first_tokens(sampling, accept_all_proposed)
  assert chi_square_pvalue(broken, exact) < 1e-12


# --- Host-side checks -----------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    (dict(drafter=NgramDrafter(VOCAB + 1, 1, 3)), r"NgramDrafter vocabulary \(62\) differs"),
    (dict(history_len=HISTORY_LEN - 1),
     rf"\(12 tokens\).*- 1 = {HISTORY_LEN} positions exceed the history size {HISTORY_LEN - 1}"),
    (dict(history_rows=2), "history buffer has 2 rows for 3 prompts"),
])
def test_bad_inputs_fail_before_compiling(change, message):
  args = dict(drafter=DRAFTER, history_len=HISTORY_LEN, history_rows=len(PROMPTS)) | change
  (config, params), drafter = TARGET, args["drafter"]
  with pytest.raises(ValueError, match=message):
    speculative_generate(SpeculativeLoop(config, 3, OUT_WIDTH), params, drafter, testing.request(PROMPTS, BUDGETS),
                         init_cache(config, len(PROMPTS), CACHE_LEN),
                         drafter.storage(args["history_rows"], args["history_len"]))


@pytest.mark.parametrize("ngram_min, ngram_max, message", [(0, 2, "ngram_min must be an integer >= 1"),
                                                           (3, 2, r"ngram_max must be an integer >= min \(3\)")])
def test_ngram_sizes_are_checked(ngram_min, ngram_max, message):
  with pytest.raises(ValueError, match=message):
    NgramDrafter(VOCAB, ngram_min, ngram_max)
