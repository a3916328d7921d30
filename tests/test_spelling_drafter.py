"""Drafting through the token-level intersection (a draft with another vocabulary): greedy output equals
the target's own for chains, early stopping and both kinds of trees; the draft reads exactly the spelled
history; the adaptive K policy works through it; sampled output follows the target's exact distribution,
and a draft whose restricted distribution is not renormalised fails the same test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from specjax import pipeline
from specjax.generation import as_token_lists
from specjax.models.load import load_model
from specjax.sampling import probabilities, sampling_params
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.drafters.spelling import intersection_drafting
from specjax.speculative.k_policy import Tables
from specjax.speculative.trees import tree as tree_lib
from specjax.speculative.plan import ChosenPlan, RoundPlan
from specjax.speculative.trees.dynamic import DynamicSpec
from tests.helpers.engine import (NO_EOS, PROMPTS, SAMPLE_PROMPT, SAMPLE_STEPS, SMALL_TARGET, TARGET,
                                  exact_distribution, target_greedy)
from tests.helpers.spelling import (FORCED_CACHE, FORCED_PROMPTS, bpe_pair_dirs, forced_rounds, run_drafter,
                                    spell_history, spelling_drafter)
from tests.helpers.k_policy import COSTS_K3, POLICY, assert_rounds_draft
from tests.helpers.stats import SAMPLE_ROWS, chi_square_pvalue

# name -> (drafter fields, loop arguments); the adaptive policy's costs are those of lengths 0 .. 3.
ADAPTIVE = dict(policy=POLICY, tables=Tables(COSTS_K3))
# The adaptive policy with a deferred lag (5); the lag's other bounds (1, the whole history) are held against
# the draft's full forward by test_the_draft_reads_the_spelled_history.
SHAPES = {
    "chain": ({}, {}), "early_stop": (dict(stop_threshold=0.3), {}), "adaptive_deferred": (dict(max_lag=5), ADAPTIVE),
    "tree": (dict(tree=tree_lib.from_branching((2, 2, 1))), {}), "dynamic_tree": (dict(tree=DynamicSpec(6, 3, 2)), {})
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_output_is_the_targets_own(shape):
  """Ragged rows, budgets that cut blocks, tokens outside the intersection emitted (only the residual can
  give them), and some draft tokens accepted. At the end the draft cache holds exactly the spelling of
  what the target's cache holds (a tree's pre-fed ids or a catch-up miscounted would shift it)."""
  fields, loop = SHAPES[shape]
  drafter, (_, target_I, _, counts_V) = spelling_drafter(TARGET, **fields)
  out = run_drafter(drafter, k=3, **loop)
  got = as_token_lists(out.tokens, out.counts)
  assert got == target_greedy()
  assert not set(sum(got, [])) <= set(target_I.tolist())
  assert int(out.acceptance.accepted.sum()) > 0
  if "policy" in loop:  # the adaptive policy's rounds drafted as it chose
    assert_rounds_draft(out, loop["policy"].candidates(3))
  committed = np.asarray(out.target_cache.lengths)
  spelled = [int(sum(counts_V[t] for t in (prompt + row)[:n])) for prompt, row, n in zip(PROMPTS, got, committed)]
  state = out.draft_state
  assert (np.asarray(state.cache.lengths) + np.asarray(state.lag)).tolist() == spelled


def test_an_eos_inside_an_accepted_block_ends_the_row():
  free = target_greedy()
  drafter, _ = spelling_drafter(TARGET)
  # Row 2's first token that is neither the prefill's nor the first of a round's block (K + 1 = 4).
  index = next(i for i in range(2, len(free[2])) if free[2].index(free[2][i]) == i and i % 4 not in (0, 1))
  eos = [free[2][index]]
  got = as_token_lists(*(lambda o: (o.tokens, o.counts))(run_drafter(drafter, eos_ids=eos)))
  assert got == target_greedy(eos_ids=eos)
  assert got[2] == free[2][:index + 1]


def test_the_pipeline_drafts_with_a_tokenizer_trained_on_another_corpus(tmp_path):
  """A target with a Qwen2-style BPE of 600 tokens, a draft with a GPT-2-style one of 900 trained on other
  sources (vocabularies that share a few hundred byte strings, ids unrelated): chosen automatically, the
  greedy output is the target's own, and the results say what the mapping holds."""
  dirs, corpus = bpe_pair_dirs(tmp_path)
  cfg = tiny.get_config()
  cfg.target, cfg.draft, cfg.model.vocab_corpus = *dirs, str(corpus)
  cfg.prompts = ("def add(a, b):\n    return", "import json\n\ndata = json.loads(")
  spec = pipeline.run(cfg, log=lambda m: None)
  cfg.mode = "autoregressive"
  alone = pipeline.run(cfg, log=lambda m: None)
  assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in alone["outputs"]]
  stats = spec["stats"]
  assert 100 < stats["vocab_intersection"] < 600 and stats["spelled_ids"] > 1
  assert 0 < stats["vocab_intersection_coverage"] <= 1


def test_a_restricted_head_keeps_the_most_frequent_shared_ids_and_the_stop_tokens(tmp_path):
  """`model.vocab` with another tokenizer: the head scores the N intersection ids most frequent in the
  corpus (by the target's tokenizer), stop tokens of the intersection always among them."""
  (target_dir, draft_dir), corpus = bpe_pair_dirs(tmp_path)
  target, draft = load_model(target_dir, "float32"), load_model(draft_dir, "float32")
  head, _, facts = intersection_drafting(target, draft, 20, str(corpus), log=lambda m: None)
  targets = np.asarray(head.targets_Vd)
  full, _, _ = intersection_drafting(target, draft, 0, str(corpus), log=lambda m: None)
  shared = set(np.asarray(full.targets_Vd).tolist())
  assert len(targets) == facts["draft_head_tokens"] == 20 and set(targets.tolist()) <= shared
  stops = [t for t in target.tokenizer.eos_ids if t in shared]
  assert stops and set(stops) <= set(targets.tolist())
  counts = np.bincount(target.tokenizer.encode(corpus.read_text(), add_special_tokens=False),
                       minlength=target.config.vocab_size)
  chosen = sorted(set(targets.tolist()) - set(stops))
  others = sorted(shared - set(targets.tolist()))
  assert counts[chosen].min() >= counts[others].max()  # no unchosen shared id is more frequent
  assert (np.asarray(head.inputs_V)[targets] == np.asarray(head.tokens_Vd)).all()


# The K policy's wanted length per round (None: K) and what each row commits; with a lag of 5 ids, plain
# rounds (0) skip the draft until pending's 1 to 3 ids would overflow some row's lag.
FORCED_SCHEDULES = {
    1: [(None, [4, 1, 2]), (None, [4, 4, 0]), (None, [0, 2, 4]), (None, [3, 4, 1]), (None, [1, 4, 4]),
        (None, [4, 4, 4])], 5: [(3, [4, 1, 2]), (0, [1, 1, 1]), (0, [1, 0, 1]), (0, [1, 1, 1]), (2, [3, 1, 2]),
                                (0, [1, 1, 1]), (3, [4, 4, 0]), (3, [1, 4, 4])], None: [(0, [1, 1, 1]), (0, [1, 0, 1]),
                                                                                        (3, [4, 1, 2]), (0, [1, 1, 1]),
                                                                                        (2, [3, 1, 2]), (3, [1, 4, 4])]
}  # the whole history: the spelled prompts wait for the first draft


@pytest.mark.parametrize("max_lag", list(FORCED_SCHEDULES))
def test_the_draft_reads_the_spelled_history(max_lag):
  """After forced outcomes (all proposed tokens accepted, some, none; pending tokens spelled by 1 to M
  draft ids; plain rounds that skip the draft and leave their ids in the lag), every proposal's
  distributions equal the draft's full forward pass over the spelled [history, pending, d_1 .. d_{i-1}],
  restricted to the intersection and renormalised, laid out on the target's ids: a miscounted spelling,
  a lag fed twice, out of order or cut, or a cache off by one shifts them."""
  drafter, (draft_I, target_I, ids_VxM,
            counts_V), state, propose, commit, score, outside = forced_rounds(max_lag=max_lag)
  k, sampling, batch, cache = 3, sampling_params(1.0), len(FORCED_PROMPTS), FORCED_CACHE
  history, pending = [list(p) for p in FORCED_PROMPTS], [int(outside[0]), int(outside[1]), int(target_I[0])]
  longest_lag = 0
  for round_, (wanted, committed) in enumerate(FORCED_SCHEDULES[max_lag]):
    plan = RoundPlan(k) if wanted is None else ChosenPlan(k, jnp.full((batch,), wanted, jnp.int32))
    proposal, state, _ = propose(drafter, state, None, jnp.asarray(pending), sampling, jax.random.key(round_), plan)
    drawn = k if wanted is None else wanted
    tokens_BxK = np.asarray(proposal.tokens)[:, :drawn]
    assert np.isin(tokens_BxK, target_I).all()
    sequences_BxT = np.zeros((batch, cache), np.int32)
    starts = []
    for b, row in enumerate(history):
      spelled = spell_history(row + [pending[b]], ids_VxM, counts_V)
      starts.append(len(spelled) - 1)
      sequence = spelled + [int(draft_I[target_I == t][0]) for t in tokens_BxK[b]]
      sequences_BxT[b, :len(sequence)] = sequence
    logits_BxTxW = np.asarray(score(jnp.asarray(sequences_BxT)))
    for b in range(batch):
      restricted_KxI = logits_BxTxW[b, starts[b]:starts[b] + drawn][:, draft_I]
      want_KxI = np.asarray(probabilities(jnp.asarray(restricted_KxI), sampling))
      np.testing.assert_allclose(np.asarray(proposal.probs)[b][:drawn, target_I], want_KxI, atol=1e-5)
    committed = np.minimum(committed, drawn + 1) * (np.array(committed) > 0)
    state = commit(drafter, state, proposal, jnp.asarray(committed, jnp.int32), None)
    for b, c in enumerate(committed):
      if c:
        history[b] += ([pending[b]] + list(tokens_BxK[b]))[:c]
        pending[b] = int(outside[(round_ + b) % len(outside)]) if (round_ + b) % 2 else int(target_I[round_ + b])
    held = np.asarray(state.cache.lengths) + np.asarray(state.lag)
    assert held.tolist() == [len(spell_history(row, ids_VxM, counts_V)) for row in history]
    longest_lag = max(longest_lag, int(np.asarray(state.lag).max()))
  assert (longest_lag > 1) == (max_lag != 1)  # plain rounds (or the prompts) left more than d_n behind


def test_a_static_trees_distributions_follow_the_spelled_history():
  """A static tree after forced accepted paths (the root alone, a path into the second branch, a whole
  path; pending tokens spelled by 1 to M ids): every node was drawn from the draft's full forward pass
  over the spelled [history, pending, its ancestors' tokens], restricted and renormalised; the cache
  then holds the spelled history. Fails for a root other than pending's last id, pre-fed ids miscounted
  at commit, or a path compacted from the wrong slots."""
  tree = tree_lib.from_branching((2, 2, 1))
  drafter, (draft_I, target_I, ids_VxM, counts_V), state, propose, commit, score, outside = forced_rounds(tree=tree)
  sampling, batch, cache = sampling_params(1.0), len(FORCED_PROMPTS), FORCED_CACHE
  paths = tree.path_table()  # [N + 1, Dt + 1]: each node's root-to-node path, padded with the node
  history, pending = [list(p) for p in FORCED_PROMPTS], [int(outside[0]), int(target_I[1]), int(outside[2])]
  for round_, leaves in enumerate([[0, 4, 10], [9, 0, 3], [10, 7, 0], [5, 10, 9]]):  # accept the path to these
    proposal, state, _ = propose(drafter, state, None, jnp.asarray(pending), sampling, jax.random.key(round_),
                                 RoundPlan(tree.max_depth))
    tokens_BxN1 = np.pad(np.asarray(proposal.tokens), ((0, 0), (1, 0)))
    for b in range(batch):
      spelled = spell_history(history[b] + [pending[b]], ids_VxM, counts_V)
      for node in range(1, tree.nodes_with_root):
        ancestors = [int(a) for a in paths[tree.parent[node]][1:tree.depth[node]]]
        sequence = spelled + [int(draft_I[target_I == tokens_BxN1[b, a]][0]) for a in ancestors]
        logits_TxW = np.asarray(score(jnp.asarray(np.pad([sequence], ((0, batch - 1), (0, cache - len(sequence)))))))
        want_I = np.asarray(probabilities(jnp.asarray(logits_TxW[0, len(sequence) - 1][draft_I]), sampling))
        np.testing.assert_allclose(
            np.asarray(proposal.probs)[b, node - 1][target_I], want_I, atol=1e-5,
            err_msg=f"round {round_} row {b} node {node}")
    path_BxDt1 = np.stack([paths[leaf] if leaf else np.zeros(tree.max_depth + 1, int) for leaf in leaves])
    accepted = [tree.depth[leaf] for leaf in leaves]
    chain = proposal.along(jnp.asarray(path_BxDt1, jnp.int32))
    state = commit(drafter, state, chain, jnp.asarray([a + 1 for a in accepted], jnp.int32), None)
    for b, leaf in enumerate(leaves):
      history[b] += [pending[b]] + [int(tokens_BxN1[b, node]) for node in paths[leaf][1:accepted[b] + 1]]
      pending[b] = int(outside[round_ + b]) if (round_ + b) % 2 else int(target_I[round_ + 2 * b])
    assert np.asarray(state.cache.lengths).tolist() == [len(spell_history(row, ids_VxM, counts_V)) for row in history]


ROWS, ALPHA = SAMPLE_ROWS, 1e-3


class _NotRenormalised(ModelDrafter):
  """A broken mapping: the proposal's distributions lose 40% of their mass (as if the draft's distribution
  were restricted to the intersection without renormalising) while its tokens are drawn from the whole."""
  def propose(self, *args, **kwargs):
    proposal, state, cache = super().propose(*args, **kwargs)
    return proposal.replace(probs=proposal.probs * 0.6), state, cache


def _first_tokens(drafter):
  """Counts [V^3] of the first three tokens over N = SAMPLE_ROWS rows of one call, K = 2, temperature 1."""
  out = run_drafter(drafter, target=SMALL_TARGET, prompts=[SAMPLE_PROMPT] * ROWS, budgets=SAMPLE_STEPS, eos_ids=NO_EOS,
                    k=2, sampling=sampling_params(1.0), seed=1, cache_len=len(SAMPLE_PROMPT) + SAMPLE_STEPS + 2,
                    out_width=SAMPLE_STEPS)
  vocab = SMALL_TARGET[0].vocab_size
  index = np.ravel_multi_index(np.asarray(out.tokens).T, [vocab] * SAMPLE_STEPS)
  return np.bincount(index, minlength=vocab**SAMPLE_STEPS)


@pytest.mark.slow
def test_sampled_tokens_follow_the_exact_target_distribution():
  """8 target ids, 5 of them shared with a 7-id draft, the others spelled by up to 2 draft ids:
  chi-square at level 0.001 on N = SAMPLE_ROWS rows; the broken mapping must fail it (p < 1e-6)."""
  exact = exact_distribution(*SMALL_TARGET, SAMPLE_PROMPT, sampling_params(1.0), SAMPLE_STEPS).ravel()
  drafter, _ = spelling_drafter(SMALL_TARGET, draft_vocab=7, shared=5, max_ids=2, seed=3)
  assert chi_square_pvalue(_first_tokens(drafter), exact) > ALPHA
  broken = _NotRenormalised(drafter.config, drafter.params, drafter.head, spelling=drafter.spelling)
  assert chi_square_pvalue(_first_tokens(broken), exact) < 1e-6
