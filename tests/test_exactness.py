"""End-to-end exactness of speculative sampling away from temperature 1, bonus token included.

What: the joint distribution of the first K + 2 generated tokens (the prefill's token, the K draft
positions of the first round and the token after them) over many seeded rows, compared by a chi-square
test with the target's exact distribution (enumerated over the vocabulary of 8), at temperatures 0.7
and 1.5, plain and with top-k, top-p and both. K = 1 (3 tokens) and K = 2 (4 tokens).

Why these shapes: two classes of engine bug pass tests run only at temperature 1 over the first
K + 1 tokens. (1) Drafts sampled at one temperature while the acceptance rule is handed the
probabilities at another: at temperature 1 the two coincide (the patch below, drafts drawn at
temperature 1 whatever T, passes test_speculative's sampling tests, all at T = 1). (2) The bonus
token (drawn after all K drafts are accepted) drawn from the wrong distribution: with K + 1 examined
tokens it is never seen. A row shows its bonus token at index K + 1 exactly when it accepted all K
drafts of its first round; with this draft (first-token acceptance 0.47-0.60) that is about half of
the rows for K = 1 and a fifth to a third for K = 2, asserted below from the acceptance counters.

Mutation checks, in the spirit of the broken-rule tests of test_speculative: for each class the same
statistic must reject an injected faulty variant. (1) The drafter's sampler (`tokens_and_probabilities`)
is patched to draw from probs ** T renormalised (the draft at temperature 1 on the same top-k/top-p
support) while the drafter still hands the probabilities at T to the rule. jit caches compiled programs
by static arguments, so each mutant passes a fresh copy of `verify` as the (static) rule: it is
traced anew with the patch in place (asserted: the patched sampler runs at trace time) and no run of
the correct engine can reuse its program (the two runs of this mutant share theirs: it reads each
row's temperature, a runtime value). (2) Rules that accept exactly like `verify` but draw the bonus from q_K
instead of q_{K+1}, or from the residual of q_{K+1} against p_K: with the same key their output equals
the correct one except at the bonus of the rows that reach it (asserted), so only the bonus position
can catch them.

Rows of their own knobs share one program (the engine always gets them per row, as a session passes
them): a greedy row beside sampled ones gives the target's greedy tokens, the sampled ones their law.
Every run, whatever its knobs, is a program whose static flags cover all of SAMPLINGS (`COVERING`), so
the samplings of one K and drafter share one compiled program.

Level and sample sizes: every chi-square test of the correct engine is at level ALPHA = 0.001 on
N = SAMPLE_ROWS = 5,000 rows of one call (fixed keys, so the outcome is deterministic; each passes); a
mutated variant must give p < 1e-6. Cells expecting fewer than 5 draws are pooled (`chi_square_pvalue`).
Power: at 10,000 rows the weakest injected fault (the bonus from the residual against p_K) scores a
statistic of 275 on 55 degrees of freedom (p = 4e-31); drafts sampled at another temperature score 312 on
16 (top-p 0.8, p = 8e-57) and 469 on 33, the broken top-k sampler 631 on 20, the bonus from q_K 13,072 on
33. (At 30,000 rows each statistic was about three times larger; at 5,000 each excess over its degrees of
freedom is about half, `tests/helpers/stats.py`.)
Run time: the compiles dominate (one per K and drafter for the correct engine, one per mutated
run); each 10,000-row run took ~1.5 s on 2 CPU cores with the tests' XLA flags.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as sampling_module, testing
from specjax.sampling import Knobs, probabilities, sample, sampling_params
from specjax.speculative import ModelDrafter, residual, verify
from specjax.speculative import loop as loop_module
from specjax.speculative.loop import SpeculativeLoop
from specjax.speculative.drafters import model_shapes
from tests.helpers.engine import exact_distribution, perturbed, tiny_model
from tests.helpers.stats import SAMPLE_ROWS, chi_square_pvalue

TARGET = tiny_model(10, vocab=8, n_layers=2, scale=0.5)
DRAFT = perturbed(TARGET, 0.05, seed=11)  # first-token acceptance 0.47 (T = 0.7) to 0.60 (T = 1.5)
PROMPT = [3, 1, 4]
ROWS = SAMPLE_ROWS
ALPHA = 1e-3  # level of every chi-square test of the correct engine
REJECTED = 1e-6  # a mutated variant must give a p-value below this
SEED = 1

# Every knob at a temperature other than 1.
SAMPLINGS = {
    "t0.7": sampling_params(0.7), "t0.7_top_k3": sampling_params(0.7, top_k=3),
    "t1.5_top_p0.8": sampling_params(1.5, top_p=0.8), "t1.5_top_k4_top_p0.9": sampling_params(1.5, top_k=4, top_p=0.9)
}
# The static flags of one program that serves them all (top-k and top-p on; a row with top-k 0 and top-p 1 gets
# the unfiltered law, `test_sampling`): the knobs are runtime arrays, so one compiled program per K and drafter.
COVERING = sampling_params(1.0).covering(
    [Knobs(float(s.temperature), int(s.top_k), float(s.top_p)) for s in SAMPLINGS.values()])
# The smallest share of rows that must show their bonus token, per K (measured: 0.47-0.60, 0.22-0.36).
MIN_BONUS_SHARE = {1: 0.4, 2: 0.15}


def _engine(sampling, k, rule, seed=SEED, stop_threshold=0.0):
  """The one call into the engine: ROWS copies of PROMPT, K + 2 new tokens each (the prefill's token,
  round one's K drafts, the token after them), with the target and draft caches sized exactly, the
  draft stopping early at `stop_threshold`, the sampling knobs one per row ([ROWS], as a session passes
  them) in the program of COVERING: every sampling and rows of mixed knobs share it. Returns the
  [ROWS, K + 2] tokens and the acceptance counters, as numpy."""
  (target_config, target_params), drafter = TARGET, ModelDrafter(*DRAFT, stop_threshold=stop_threshold)
  steps = k + 2
  values = [np.broadcast_to(np.asarray(getattr(sampling, name)), (ROWS,)).tolist() for name in Knobs._fields]
  per_row = COVERING.for_rows([Knobs(*row) for row in zip(*values)])
  request = testing.request([PROMPT] * ROWS, steps, per_row, seed=seed)  # EOS off
  out = testing.speculate(SpeculativeLoop(target_config, k, rule=rule), target_params, drafter, request,
                          cache_len=len(PROMPT) + steps + k - 1)
  return np.asarray(out.tokens), jax.tree.map(np.asarray, out.acceptance)


@functools.cache
def _correct(name, k):
  """`_engine` with the real rule (cached: the mutation tests compare against the same run)."""
  return _engine(SAMPLINGS[name], k, verify)


@functools.cache
def _exact(name, steps):
  """The target's exact distribution of the first `steps` tokens, flattened to [V ** steps]."""
  return exact_distribution(*TARGET, PROMPT, SAMPLINGS[name], steps).ravel()


def _pvalue(tokens_ZxT, name):
  """Chi-square p-value of the rows' first S tokens against the exact joint distribution."""
  steps, vocab = tokens_ZxT.shape[1], TARGET[0].vocab_size
  counts = np.bincount(np.ravel_multi_index(tokens_ZxT.T, [vocab] * steps), minlength=vocab**steps)
  return chi_square_pvalue(counts, _exact(name, steps))


def _shows_bonus(acceptance, k):
  """[Z] bool: the row accepted all K drafts of its first round, so its token K + 1 (0-based) is the
  bonus token; with a budget of K + 2 such a row is done after that one round."""
  return (acceptance.rounds == 1) & (acceptance.accepted == k)


@pytest.mark.slow
@pytest.mark.parametrize("name, k", [(name, 2) for name in sorted(SAMPLINGS)] + [("t1.5_top_p0.8", 1)])
def test_sampled_tokens_and_bonus_follow_the_exact_target_distribution(name, k):
  """Chi-square at level 0.001 on N = SAMPLE_ROWS rows over the first K + 2 tokens, which include the
  bonus token of every row that accepted its first K drafts (at least MIN_BONUS_SHARE of them). K = 2
  for every sampling; K = 1 (one draft, the bonus right after it) with top-p at T = 1.5 (the other knobs
  at K = 1 would run the same program again: K = 2 runs them)."""
  tokens_ZxT, acceptance = _correct(name, k)
  assert tokens_ZxT.shape == (ROWS, k + 2)
  assert _shows_bonus(acceptance, k).mean() > MIN_BONUS_SHARE[k]
  assert _pvalue(tokens_ZxT, name) > ALPHA


def test_greedy_and_sampled_rows_of_one_batch_each_follow_their_own_law():
  """Each row's own knobs in one sampled program (K = 2, the program of every K = 2 run above): rows
  alternate greedy (temperature 0: one-hot distributions, drafted and verified by the sampled rule) and
  T = 0.7 with top-k 3. Every greedy row gives the target's greedy tokens exactly (the argmax of the
  reference's greedy law, a point mass); the sampled rows pass the chi-square test at level 0.001
  (N = SAMPLE_ROWS / 2, first 4 tokens, the bonus included) against the target's exact law. Alternating
  rows catch knobs read from the wrong row (verify logits [B, K + 1, V] mapped to rows by anything but
  their first axis)."""
  k, steps = 2, 4
  tokens_ZxT, _ = _engine(sampling_params([0.0, 0.7] * (ROWS // 2), top_k=3), k, verify)
  greedy_law = exact_distribution(*TARGET, PROMPT, sampling_params(0.0), steps)
  greedy_T = np.unravel_index(np.argmax(greedy_law), greedy_law.shape)
  assert greedy_law[greedy_T] == 1.0
  np.testing.assert_array_equal(tokens_ZxT[0::2], np.broadcast_to(greedy_T, (ROWS // 2, steps)))
  assert _pvalue(tokens_ZxT[1::2], "t0.7_top_k3") > ALPHA


def _fresh_verify():
  """A new rule object that behaves as `verify`: a new static argument, so the engine is traced and
  compiled anew (seeing whatever is patched now) and no other run shares the program."""
  def rule(*args):
    return verify(*args)

  return rule


# The rule of every run with drafts sampled at temperature 1 (one program for both samplings: the patch reads
# each row's temperature), and the shapes its patched sampler was traced at (only ever with the patch in place).
_AT_TEMPERATURE_ONE_RULE, _AT_TEMPERATURE_ONE_TRACED = _fresh_verify(), []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t0.7", "t1.5_top_p0.8"])
def test_drafts_sampled_at_another_temperature_fail(monkeypatch, name):
  """Bug class (1): the drafter draws from probs ** T renormalised (probs at T go as exp(logits / T):
  this is temperature 1 on the same top-k/top-p support) but hands the probabilities at T to the rule.
  At T = 1 the patch is the identity, which is why tests at T = 1 cannot see it. The correct engine
  passes at level 0.001, the mutated one is rejected with p < 1e-6 (K = 1, N = SAMPLE_ROWS)."""
  drafter_module = model_shapes  # where the model drafter's chain finds its sampler

  def draw_at_temperature_one(key, logits_BxV, params):
    probs_BxV = probabilities(logits_BxV, params)
    _AT_TEMPERATURE_ONE_TRACED.append(probs_BxV.shape)
    tempered_BxV = probs_BxV**jnp.expand_dims(params.temperature, -1)  # each row's T ([B] or [])
    return sample(key, tempered_BxV / tempered_BxV.sum(axis=-1, keepdims=True)), probs_BxV

  monkeypatch.setattr(drafter_module, "tokens_and_probabilities", draw_at_temperature_one)
  mutated_ZxT, _ = _engine(SAMPLINGS[name], 1, _AT_TEMPERATURE_ONE_RULE)
  monkeypatch.undo()
  correct_ZxT, _ = _correct(name, 1)
  assert _AT_TEMPERATURE_ONE_TRACED  # the patched sampler was traced into the program that ran
  # Same key: a tempered draw often keeps the same token, but thousands of rows must change.
  assert (mutated_ZxT != correct_ZxT).any(axis=1).mean() > 0.02
  assert _pvalue(correct_ZxT, name) > ALPHA
  assert _pvalue(mutated_ZxT, name) < REJECTED


def _bonus_from(wrong_bonus):
  """A broken rule: `verify` with q_{K+1} replaced by `wrong_bonus(p_BxKxV, q_BxK1xV)` [B, V]. verify
  reads q_{K+1} only after accepting every proposed token (the model drafter always proposes all K),
  so this rule accepts exactly as verify does (same keys) and differs only in the bonus token's
  distribution."""
  def rule(key, proposal, target_probs_BxK1xV):
    bonus_BxV = wrong_bonus(proposal.probs, target_probs_BxK1xV)
    return verify(key, proposal, target_probs_BxK1xV.at[:, proposal.k].set(bonus_BxV))

  return rule


BONUS_BUGS = {  # module-level objects: one compiled program per (rule, K); each rule runs at one K
    "q_K": _bonus_from(lambda p_BxKxV, q_BxK1xV: q_BxK1xV[:, -2]),
    "residual_against_p_K": _bonus_from(lambda p_BxKxV, q_BxK1xV: residual(q_BxK1xV[:, -1],
                                                                             p_BxKxV[:, -1])),
}


@pytest.mark.parametrize("bug, k", [("q_K", 1), ("residual_against_p_K", 2)])
def test_bonus_drawn_from_the_wrong_distribution_fails(bug, k):
  """Bug class (2): the bonus from q_K, or from the residual of q_{K+1} against p_K. Same key as the
  correct run, so the tokens agree except at the bonus of the rows that reach it, where they differ
  often; the correct engine passes at level 0.001, the mutated one gives p < 1e-6 (N = SAMPLE_ROWS, T = 0.7,
  plain sampling: full support, so the statistic itself rejects, not a draw outside the support)."""
  name = "t0.7"
  mutated_ZxT, mutated_acceptance = _engine(SAMPLINGS[name], k, BONUS_BUGS[bug])
  correct_ZxT, acceptance = _correct(name, k)
  shows_bonus_Z = _shows_bonus(acceptance, k)
  np.testing.assert_array_equal(mutated_acceptance.accepted, acceptance.accepted)
  before_bonus = slice(0, k + 1)  # the prefill's token and round one's K drafts (or residual)
  np.testing.assert_array_equal(mutated_ZxT[:, before_bonus], correct_ZxT[:, before_bonus])
  np.testing.assert_array_equal(mutated_ZxT[~shows_bonus_Z, k + 1], correct_ZxT[~shows_bonus_Z, k + 1])
  assert (mutated_ZxT[shows_bonus_Z, k + 1] != correct_ZxT[shows_bonus_Z, k + 1]).mean() > 0.05
  assert _pvalue(correct_ZxT, name) > ALPHA
  assert _pvalue(mutated_ZxT, name) < REJECTED


@pytest.mark.parametrize("name", ["t0.7_top_k3", "t1.5_top_p0.8"])
def test_early_stopped_drafts_keep_the_exact_distribution(name):
  """The model drafter with `stop_threshold` = 0.75 (rows stop proposing at their first draft token
  whose distribution's top probability is below it; the round's verify pass narrows to the longest
  live proposal): chi-square at level 0.001 on N = SAMPLE_ROWS rows, K = 2, over the first 4 tokens, with a
  real mix of short and full proposals. (Exactness is structural here: what is proposed was drawn from
  p, and the rest is never accepted; this guards the bookkeeping of short proposals end to end.)"""
  k, threshold = 2, 0.75
  tokens_ZxT, acceptance = _engine(SAMPLINGS[name], k, verify, stop_threshold=threshold)
  short = 1.0 - acceptance.proposed.sum() / (k * acceptance.rounds.sum())
  assert 0.1 < short < 0.9  # a real mix of short and full proposals
  assert _pvalue(tokens_ZxT, name) > ALPHA


def _top_k_keeps_one_fewer(probabilities_fn):
  """A broken sampler: top-k keeps k - 1 tokens (the k-th largest is dropped)."""
  def broken(logits_xV, params):
    return probabilities_fn(logits_xV, params.replace(top_k=params.top_k - 1) if params.use_top_k else params)

  return broken


SAMPLER_BUGS = {"top_k_keeps_k_minus_1": ("t0.7_top_k3", _top_k_keeps_one_fewer)}  # one engine compile each


@pytest.mark.parametrize("bug", sorted(SAMPLER_BUGS))
def test_a_broken_sampler_fails_against_the_independent_reference(monkeypatch, bug):
  """`sampling.probabilities` broken (top-k keeping k - 1 tokens) everywhere the engine reads it
  (`sampling` itself, behind the drafter's sampler and the first token, and the loop's verify pass).
  The exact reference (`exact_distribution`: numpy float64 probabilities, `specjax.testing.reference`)
  does not move with it: the mutated engine fails with p < 1e-6 (K = 1, N = SAMPLE_ROWS, first 3 tokens,
  T = 0.7, top-k 3), while the correct one passes at level 1e-3 (`test_sampled_tokens_and_bonus_...`).
  A reference built on the library's own `probabilities` moved with the mutant and passed it."""
  name, make_bug = SAMPLER_BUGS[bug]
  broken = make_bug(sampling_module.probabilities)
  traced = []

  def traced_broken(logits_xV, params):
    traced.append(logits_xV.shape)
    return broken(logits_xV, params)

  monkeypatch.setattr(sampling_module, "probabilities", traced_broken)
  monkeypatch.setattr(loop_module, "probabilities", traced_broken)
  mutated_ZxT, _ = _engine(SAMPLINGS[name], 1, _fresh_verify())
  monkeypatch.undo()
  assert traced  # the broken sampler was traced into the program that ran
  assert _pvalue(mutated_ZxT, name) < REJECTED
