"""The suffix drafter: its pool bookkeeping and proposals against plain-Python statements of the rule,
and the engine driven by it.

Unit: `appended` keeps the newest tokens of every call, separated, like a Python list does; proposals
on random pools and batches over a 3-token vocabulary (every match size, ties, cut continuations,
eviction-cut pool sequences) equal `_reference` (the longest match, its latest occurrences, the most
frequent path with its probability cut and length limit) for chains and spines, with and without the
other rows of the batch.
Greedy: the output equals the target's own greedy decoding for ragged prompts with the random and the
cycling targets, for a chain and spines, with an empty pool and with a pool holding earlier outputs
(where most proposals are accepted).
Sampling: with a pool holding a continuation of every first token, the first three tokens over 4,000
rows follow the target's exact distribution at T = 0.7 (chi-square, level 0.001), and a rule that
accepts every proposed token (a pool token without the target's probability) fails the same test.
Decoder: a second call of the same prompt drafts from the first call's output (the pool), the warm-up
call teaches the pool nothing, and `reset_pool` forgets.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import testing
from specjax.errors import ConfigError
from specjax.generation import as_token_lists, pad_prompts
from specjax.models.kv_cache import init_cache
from specjax.sampling import sampling_params
from specjax.speculative import verify
from specjax.speculative.drafters.suffix import SuffixDrafter, longest_occurrences, warm_pool
from specjax.speculative.drafters.suffix_pool import SEPARATOR, Pool, appended, empty_pool
from specjax.speculative.loop import SpeculativeLoop, speculative_generate
from specjax.speculative.plan import RoundPlan
from specjax.speculative.trees.tree import from_branching
from tests.helpers.cli import cli_config
from tests.helpers.cli import model_dirs  # noqa: F401 (the fixture)
from tests.helpers.engine import (CACHE_LEN, GREEDY, OUT_WIDTH, SAMPLE_PROMPT, SAMPLE_STEPS, SMALL_TARGET, VOCAB,
                                  accept_all_proposed, first_tokens_pvalue)
from tests.helpers.ngram import BUDGETS, HISTORY_LEN, MODELS, PROMPTS, free_greedy


def _reference_pool(calls, capacity):
  """The pool after `calls` (lists of (prompt, output) rows) as a Python list: every nonempty row's
  tokens then a separator, the newest `capacity` kept, separators in front."""
  tokens = []
  for rows in calls:
    for prompt, output in rows:
      if prompt or output:
        tokens += prompt + output + [SEPARATOR]
  return ([SEPARATOR] * capacity + tokens)[-capacity:]


def test_appended_keeps_the_newest_tokens_of_every_call():
  rng = np.random.default_rng(0)
  pool, calls = empty_pool(23), []
  for _ in range(6):
    rows = [(list(map(int, rng.integers(0, 9,
                                        rng.integers(0, 5)))), list(map(int, rng.integers(0, 9, rng.integers(0, 4)))))
            for _ in range(3)]
    calls.append(rows)
    prompts, lengths = np.zeros((3, 4), np.int32), np.array([len(p) for p, _ in rows], np.int32)
    outputs, counts = np.full((3, 5), 7, np.int32), np.array([len(o) for _, o in rows], np.int32)
    for b, (prompt, output) in enumerate(rows):
      prompts[b, :len(prompt)], outputs[b, :len(output)] = prompt, output
    pool = appended(pool, prompts, lengths, outputs, counts)
    assert list(map(int, pool)) == _reference_pool(calls, 23)


def _reference(pool, contexts, b, k, max_match, occurrences, factor, offset, min_prob, across_rows, branches):
  """Row b's proposal in plain Python: R branches, each a token list. The searched sequences are the
  pool's (split at separators), then the contexts of every row (only row b's without `across_rows`),
  in that order; an occurrence of the last n context tokens is a window of a sequence followed by one
  of its tokens; the longest n <= max_match with one wins, and its `occurrences` latest are walked."""
  pieces = [[]]
  for token in pool:
    pieces.append([]) if token == SEPARATOR else pieces[-1].append(token)
  sequences = [p for p in pieces if p] + ([c for c in contexts] if across_rows else [contexts[b]])
  context, found, length = contexts[b], [], 0
  for n in range(1, min(max_match, len(context)) + 1):
    here = [(s, j)
            for s, seq in enumerate(sequences)
            for j in range(n - 1,
                           len(seq) - 1)
            if seq[j - n + 1:j + 1] == context[-n:]]
    if here:
      found, length = here, n
  if not found:
    return [[] for _ in range(branches)]
  latest = found[::-1][:occurrences]
  continuations = [sequences[s][j + 1:j + 1 + k] for s, j in latest]
  limit = min(k, math.floor(length * factor + offset))

  def ranked(alive, d):
    """Tokens at depth d of the alive continuations, most frequent first, ties to the latest."""
    counts = {}
    for i, c in enumerate(alive):
      if len(c) > d:
        counts.setdefault(c[d], [0, i])[0] += 1
    return sorted(counts, key=lambda t: (-counts[t][0], counts[t][1])), counts

  heads, head_counts = ranked(continuations, 0)
  out = []
  for r in range(branches):
    path, prob, alive = [], 1.0, continuations
    for d in range(k):
      order, counts = (heads[r:], head_counts) if d == 0 else ranked(alive, d)
      if not order:
        break
      token = order[0]
      prob *= counts[token][0] / sum(len(c) > d for c in alive)
      if prob < min_prob or d >= limit:
        break
      path.append(token)
      alive = [c for c in alive if len(c) > d and c[d] == token]
    out.append(path)
  return out


SETTINGS = {  # name -> (drafter fields, K)
    "defaults": (dict(max_match=12, occurrences=64, factor=1.0, offset=0.0, min_prob=0.1, across_rows=True), 5),
    "short_match_few_occurrences": (dict(max_match=2, occurrences=3, factor=2.0, offset=1.0, min_prob=0.0,
                                         across_rows=True), 4),
    "own_row_only": (dict(max_match=4, occurrences=8, factor=0.5, offset=2.0, min_prob=0.25, across_rows=False), 5),
}


@pytest.mark.parametrize("branches", [1, 3])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_propose_matches_the_reference_on_random_pools_and_batches(name, branches):
  """12 batches of 4 contexts of 1 to 14 tokens over 3 ids (one of them ending in a 4th id every other
  batch), searched with a pool of 40 tokens that the previous batches' rows were appended to (the
  oldest cut by eviction)."""
  fields, k = SETTINGS[name]
  tree = None if branches == 1 else from_branching((branches,) + (1,) * (k - 1))
  drafter = SuffixDrafter(vocab_size=VOCAB, pool=Pool.of(empty_pool(40), fields["max_match"]), tree=tree, **fields)
  rng, lengths_seen = np.random.default_rng(branches), set()
  for batch in range(12):
    contexts = [list(map(int, rng.integers(0, 3, rng.integers(1, 15)))) for _ in range(4)]
    contexts[3][-1] = 7 if batch % 2 else contexts[3][-1]  # a pending token never seen: no match
    proposal = _propose(drafter, contexts, k)
    tokens, lengths = np.asarray(proposal.tokens), np.asarray(proposal.lengths)
    pool = list(map(int, drafter.pool.tokens))
    for b in range(4):
      want = _reference(pool, contexts, b, k, branches=branches, **fields)
      if tree is None:
        assert list(tokens[b, :lengths[b]]) == want[0], (b, contexts, pool)
      else:  # branch r's depth-d node is slot d * R + r; slots past its path hold V
        got = [[int(t) for t in tokens[b, r::branches] if t != VOCAB] for r in range(branches)]
        assert got == want and lengths[b] == max(map(len, want)), (b, contexts, pool)
      lengths_seen.add(len(want[0]))
    padded, context_lengths = pad_prompts(contexts)
    drafter = drafter.remember(padded, context_lengths, np.zeros((4, 1), np.int32), np.zeros(4, np.int32))
  assert {0, 1, 2} < lengths_seen  # misses, single tokens and longer paths


_longest_occurrences_jit = jax.jit(longest_occurrences, static_argnums=(2, 3))  # one program, not op by op


@pytest.mark.parametrize("capacity, vocab, max_match, occurrences", [(3000, 3, 6, 8), (1000, 2, 12, 64),
                                                                     (700, 50, 3, 5)])
def test_the_pool_index_finds_what_a_pass_over_the_pool_finds(capacity, vocab, max_match, occurrences):
  """Random pools (sequences of 1 to 40 tokens; few ids, so that matches are long and occur many times,
  and many ids, so that most are short or missing) searched by 64 random suffixes, some running past
  their context's start (-2), some copied from the pool: the index's match length and latest
  occurrences equal the linear pass's (`longest_occurrences`) over the pool alone."""
  rng = np.random.default_rng(capacity)
  tokens = []
  while len(tokens) < capacity + 100:
    tokens += list(map(int, rng.integers(0, vocab, rng.integers(1, 41)))) + [SEPARATOR]
  tokens = np.asarray(tokens[-capacity:], np.int32)
  suffixes = rng.integers(0, vocab, (64, max_match)).astype(np.int32)
  for row in range(0, 64, 4):  # a window of the pool, read backwards
    end = int(rng.integers(max_match, capacity))
    suffixes[row] = tokens[end - max_match + 1:end + 1][::-1]
  context_lengths = rng.integers(1, 2 * max_match + 1, 64)
  past_start = (np.arange(max_match)[None, :] >= context_lengths[:, None]) | (np.cumsum(suffixes < 0, axis=1) > 0)
  suffixes[past_start] = -2
  pool = Pool.of(tokens, max_match)
  want_match, want_ends = _longest_occurrences_jit(jnp.asarray(tokens), jnp.asarray(suffixes), max_match, occurrences)
  got_match, got_ends = jax.jit(Pool.search, static_argnums=2)(pool, jnp.asarray(suffixes), occurrences)
  np.testing.assert_array_equal(got_match, want_match)
  np.testing.assert_array_equal(np.where(np.asarray(want_match)[:, None] > 0, got_ends, -1),
                                np.where(np.asarray(want_match)[:, None] > 0, want_ends, -1))
  assert len(set(map(int, want_match))) > 2


_propose_jit = jax.jit(SuffixDrafter.propose)


def _propose(drafter, contexts, k):
  padded, lengths = pad_prompts([c[:-1] or [0] for c in contexts])
  lengths = np.array([len(c) - 1 for c in contexts], np.int32)
  state = drafter.init(drafter.storage(len(contexts), 16), jnp.asarray(padded), jnp.asarray(lengths), None)
  pending = jnp.asarray([c[-1] for c in contexts], jnp.int32)
  proposal, _, _ = _propose_jit(drafter, state, None, pending, GREEDY, jax.random.key(0), RoundPlan(k))
  return proposal


# --- The engine, greedy ---------------------------------------------------------------------------


def _generate(model, drafter, k):
  (config, params), batch = model, len(PROMPTS)
  return speculative_generate(SpeculativeLoop(config, k, OUT_WIDTH), params, drafter, testing.request(PROMPTS, BUDGETS),
                              init_cache(config, batch, CACHE_LEN), drafter.storage(batch, HISTORY_LEN))


@pytest.mark.parametrize("spines", [False, True], ids=["chain", "spines"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_greedy_equals_target_greedy_with_and_without_a_pool(model_name, spines):
  """K = 4. With a pool holding each prompt and its greedy output (an earlier call of the same
  prompts), at least half of all proposed tokens are accepted; every output equals the target's."""
  k = 4
  free = free_greedy(MODELS[model_name])
  want = [f[:b] for f, b in zip(free, BUDGETS)]
  tree = from_branching((2, 1, 1, 1)) if spines else None
  drafter = SuffixDrafter(vocab_size=VOCAB, pool=Pool.of(empty_pool(128), 12), tree=tree)
  empty = _generate(MODELS[model_name], drafter, k)
  assert as_token_lists(empty.tokens, empty.counts) == want
  padded, lengths = pad_prompts(PROMPTS)
  outputs = np.zeros((len(PROMPTS), len(free[0])), np.int32)
  outputs[:] = free
  remembered = drafter.remember(padded, lengths, outputs, np.asarray(BUDGETS, np.int32))
  pooled = _generate(MODELS[model_name], remembered, k)
  assert as_token_lists(pooled.tokens, pooled.counts) == want
  proposed, accepted = int(pooled.acceptance.proposed.sum()), int(pooled.acceptance.accepted.sum())
  assert accepted >= proposed / 2 and accepted > int(empty.acceptance.accepted.sum())
  assert int(pooled.target_calls) < int(empty.target_calls)


# --- The engine, sampling -------------------------------------------------------------------------


def test_sampled_tokens_follow_the_exact_target_distribution_with_a_pool_of_the_continuation():
  """T = 0.7, K = 2, N = 4,000 rows of one call, chi-square at level 0.001; the pool holds the prompt
  followed by every first token t and a continuation of it, so every row's first round proposes two
  pool tokens after its first token. The rule that accepts whatever is proposed must fail it
  (p < 1e-12)."""
  (config, params), sampling, rows = SMALL_TARGET, sampling_params(0.7), 4_000
  vocab = config.vocab_size
  continuations = np.asarray([[t, (t + 1) % vocab, (t + 3) % vocab] for t in range(vocab)], np.int32)
  pool = appended(empty_pool(64), np.tile(np.asarray([SAMPLE_PROMPT], np.int32), (vocab, 1)),
                  np.full(vocab, len(SAMPLE_PROMPT), np.int32), continuations, np.full(vocab, 3, np.int32))
  drafter = SuffixDrafter(vocab_size=vocab, pool=Pool.of(pool, 12), across_rows=False, min_prob=0.0)
  request = testing.request([SAMPLE_PROMPT] * rows, SAMPLE_STEPS, sampling, seed=1)

  def first_tokens(rule):
    out = testing.speculate(SpeculativeLoop(config, 2, rule=rule), params, drafter, request,
                            cache_len=len(SAMPLE_PROMPT) + SAMPLE_STEPS + 1)
    return np.asarray(out.tokens), out.acceptance

  tokens, acceptance = first_tokens(verify)
  assert first_tokens_pvalue(SMALL_TARGET, SAMPLE_PROMPT, sampling, tokens) > 1e-3
  assert (np.asarray(acceptance.proposed) > 0).all() and (np.asarray(acceptance.accepted) > 0).mean() > 0.1
  broken, _ = first_tokens(accept_all_proposed)
  assert first_tokens_pvalue(SMALL_TARGET, SAMPLE_PROMPT, sampling, broken) < 1e-12


# --- The Decoder's pool ---------------------------------------------------------------------------


def test_a_decoder_drafts_from_its_earlier_calls_and_forgets_on_reset(model_dirs):
  """The first call (after the program's warm-up call) and the first after `reset_pool` draft alike:
  the warm-up call (budget 2, before the first) taught the pool nothing."""
  prompt = ["the quick brown fox"]
  dec = specjax.Decoder(config=cli_config(model_dirs, drafter="suffix", max_new_tokens=24, k=4))
  first = dec.generate(prompt)
  second = dec.generate(prompt)
  assert second.token_ids == first.token_ids
  assert second.stats["acceptance"]["accepted"] >= len(first.token_ids[0]) / 2 > first.stats["acceptance"]["accepted"]
  dec.reset_pool()
  assert dec.generate(prompt).stats["acceptance"] == first.stats["acceptance"]


def test_a_corpus_warms_the_pool_up_to_its_budget(tmp_path):
  """Paragraphs of a text file, encoded and separated, in order; the budget keeps the newest tokens."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("abc\n\nde\n\nfgh")
  encode = lambda text, add_special_tokens: [ord(c) - ord("a") for c in text]
  pool, added = warm_pool(empty_pool(12), str(corpus), encode, budget=100)
  assert list(map(int, pool)) == [SEPARATOR, 0, 1, 2, SEPARATOR, 3, 4, SEPARATOR, 5, 6, 7, SEPARATOR] and added == 8
  pool, added = warm_pool(empty_pool(12), str(corpus), encode, budget=5)  # reading stops past the budget
  assert list(map(int, pool)) == [SEPARATOR] * 7 + [2, SEPARATOR, 3, 4, SEPARATOR] and added == 3


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_match", 0, "config.suffix.max_match must be an integer >= 1"),
        ("min_prob", 1.5, r"config.suffix.min_prob must be in \[0, 1\]"),
        ("pool_tokens", -1, r"config.suffix.pool_tokens must be an integer in \[0, 16777216\]"),
        ("pool_tokens", 10**12, r"config.suffix.pool_tokens must be an integer in \[0, 16777216\]"),  # not 4 TB
    ])
def test_bad_settings_fail_with_one_line_naming_the_field(model_dirs, field, value, message):
  with pytest.raises(ConfigError, match=message):
    specjax.Decoder(config=cli_config(model_dirs, drafter="suffix", suffix={field: value}))


def test_a_tree_that_is_not_spines_is_refused_by_its_config_string(model_dirs):
  with pytest.raises(ConfigError, match=r"^config.tree \(2, 2, 1\): the suffix drafter drafts spines"):
    specjax.Decoder(config=cli_config(model_dirs, drafter="suffix", tree="(2, 2, 1)", k=3))
