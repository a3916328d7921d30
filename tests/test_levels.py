"""The levels drafter (`drafter = "levels"`): a middle model, the target's int4 copy, verifying prompt
lookup's proposals by the acceptance rule inside the drafter's round.

Unit: three rounds of propose and commit with forced outcomes (every token accepted, so the last drawn
one may lag and lead the next round's first inner pass; the pending token alone; a prefix) on a ragged
batch, K = 4 and inner_k = 2 (inner rounds overshoot K), at temperature 0.5: every proposed token's
reported distribution is the middle's own at that position, from one full forward of the committed
tokens and the draws before it (float64 reference of the sampling), for a target whose middle accepts
lookup tokens (fewer passes than tokens) and one whose middle draws a token a pass (real lags): a
distribution reported one position off, or a middle cache that lost or repeated a token, fails.
Engine: greedy output equals the target's own greedy decoding on a ragged batch (a budget that cuts
blocks), for a random target and one whose output cycles (lookup tokens accepted inside: fewer middle
passes than drawn tokens); with the target itself as the middle every proposed token is accepted (the
proposals are the middle's greedy chain). The first three sampled tokens of SAMPLE_ROWS rows follow the
target's exact law (chi-square at level 0.001 over 8^3 cells, `testing.check_sampled`).
Config: bad settings fail before any model loads, in one line naming the field; `drafter = "levels"`
builds from the config.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decode_spec, metrics, testing
from specjax.errors import ConfigError
from specjax.generation import pad_prompts
from specjax.models import quantized
from specjax.models.load import LoadedModel
from specjax.models.transformer import output_head
from specjax.sampling import sampling_params
from specjax.speculative.drafters.levels import LevelsDrafter
from specjax.speculative.plan import RoundPlan
from tests.helpers.cli import cli_config
from tests.helpers.engine import GREEDY, SMALL_TARGET, TARGET
from tests.helpers.levels import levels_drafter, middle_distributions
from tests.helpers.ngram import MODELS, PROMPTS, SAMPLE_PROMPT
from tests.helpers.stats import SAMPLE_ROWS

K, INNER_K = 4, 2
# Ragged prompts holding the cycling target's int4 copy's own greedy cycle (8 51 34), which prompt lookup
# then proposes to it.
CYCLE_PROMPTS = [[8, 51, 34, 8, 51, 34, 8, 51], [34, 8, 51, 34], [60, 1, 2, 8, 51, 34, 8, 51, 34, 1, 2, 3]]
_init, _propose, _commit = jax.jit(LevelsDrafter.init), jax.jit(LevelsDrafter.propose), jax.jit(LevelsDrafter.commit)


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_proposals_are_the_middle_models_draws_with_its_distributions(model_name):
  """The cycling target's middle accepts lookup tokens (fewer passes than tokens); the random one's draws
  a token a pass, so a round whose every token the target accepts leaves the last one unfed: a lag that
  the next round's first pass must feed (a commit that counted it as fed fails)."""
  sampling, drafter = sampling_params(0.5), levels_drafter(MODELS[model_name], INNER_K)
  padded, lengths = pad_prompts(CYCLE_PROMPTS)
  state = _init(drafter, drafter.storage(len(CYCLE_PROMPTS), 40), padded, lengths, None)
  history, calls, lags = [list(p) for p in CYCLE_PROMPTS], [], 0
  for round_, committed in enumerate([[K + 1, 1, 3], [1, K + 1, K + 1], [3, 2, 1]]):
    # The middle's greedy token after the history (as a target's would be): row 0's cycle goes on.
    pending = np.argmax(middle_distributions(drafter, history, map(len, history), 1, GREEDY)[:, 0], axis=1).tolist()
    proposal, state, _ = _propose(drafter, state, None, jnp.asarray(pending, jnp.int32), sampling,
                                  jax.random.key(round_), RoundPlan(K))
    tokens = np.asarray(proposal.tokens).tolist()
    np.testing.assert_array_equal(proposal.lengths, K)
    want = middle_distributions(drafter, [h + [p] + t for h, p, t in zip(history, pending, tokens)],
                                [len(h) + 1 for h in history], K, sampling)
    np.testing.assert_allclose(np.asarray(proposal.probs), want, atol=2e-5)
    assert np.all(np.take_along_axis(want, np.asarray(tokens)[:, :, None], axis=2) > 0)
    calls.append(int(proposal.calls))
    state = _commit(drafter, state, proposal, jnp.asarray(committed, jnp.int32), None)
    for row, (p, t, c) in enumerate(zip(pending, tokens, committed)):
      history[row] += ([p] + t)[:c]
    np.testing.assert_array_equal(state.inner.lengths, [len(h) for h in history])
    lags += int(np.sum(state.middle.lag))
  assert lags > 0  # a row's first inner pass of a later round led with its lag
  if model_name == "cycling":
    assert min(calls) < K  # the inner level's tokens were accepted: fewer middle passes than tokens


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_greedy_output_is_the_targets_and_proposals_the_middles_greedy_chain(model_name):
  """The middle is the target itself (float): its greedy chain is the target's, so every proposed token
  is accepted."""
  model = MODELS[model_name]
  out = testing.check_greedy(levels_drafter(model, 3, "float"), model, PROMPTS, k=K, max_new_tokens=19, cache_len=40)
  total = metrics.summarize(out.acceptance)["total"]
  assert total["accepted"] == total["proposed"] > 0
  if model_name == "cycling":  # prompt lookup predicts its cycle: the middle checks several tokens a pass
    assert int(out.draft_calls) < K * (int(out.target_calls) - 1)


def test_sampled_output_follows_the_target():
  """One middle pass width (the narrow ones are the unit test's): a program that compiles faster."""
  testing.check_sampled(levels_drafter(SMALL_TARGET, 2, narrow_passes=False), SMALL_TARGET, SAMPLE_PROMPT, k=2,
                        rows=SAMPLE_ROWS, steps=3)


@pytest.mark.parametrize("overrides, message", [
    (dict(weights="int3"), r"^config.levels.weights: 'int3' is not a weight format"),
    (dict(inner="suffix"), r"^config.levels.inner must be one of \('ngram',\), got 'suffix'$"),
    (dict(inner_k=0), r"^config.levels.inner_k must be an integer >= 1, got 0$"),
])
def test_bad_settings_fail_in_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message):
    decode_spec.from_config(cli_config(["no-target", "no-draft"], drafter="levels", levels=overrides))


def test_the_levels_drafter_builds_from_the_config():
  """No draft model loads; the middle is the target's own weights in `levels.weights` (int4 by default),
  a chain with a lag of one."""
  spec = decode_spec.from_config(cli_config(["no-target", "no-draft"], drafter="levels", levels=dict(inner_k=2)))
  assert not spec.loads_draft_model
  tokenizer = type("Tokenizer", (), {"fingerprint": lambda self, below=None: "one"})()  # the draft's is the target's
  target = LoadedModel("tiny", *TARGET, tokenizer=tokenizer)
  drafter, facts = LevelsDrafter.build(spec.drafter_settings, target, None, log=lambda m: None)
  assert isinstance(drafter, LevelsDrafter) and drafter.inner_k == 2 and facts["draft_weights"] == "int4:32"
  assert drafter.middle.config == TARGET[0] and drafter.middle.max_lag == 1 and drafter.middle.tree is None
  assert output_head(drafter.middle.config, drafter.middle.params).format == quantized.parse("int4")
