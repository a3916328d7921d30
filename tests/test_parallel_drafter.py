"""The parallel drafter (`drafters/parallel.py`): K draft tokens from one draft pass per round.

- Greedy output equals the target's own greedy decoding, token for token, whatever the draft (the
  target itself, a perturbed copy, an unrelated model), under the fixed and the adaptive K policy, and
  the draft runs exactly one pass per round (`draft_calls` = rounds).
- The cache holds real ids only: with the target itself as the draft, q_1 (read at pending) is the
  target's own distribution, so every round accepts its first draft token. A draft that kept the mask
  pass's cache entries as the accepted tokens' (`MaskEntriesKept`) reads masks in its history and
  misses some (it stays exact: only this test sees it).
- Sampled at T = 0.7 the first K + 2 tokens (K = 2: the prefill's token, the two drafts, the bonus or
  the correction) follow the target's exact distribution: chi-square at level 0.001 on N = SAMPLE_ROWS rows
  of one call (fixed seed), with a perturbed draft and with a near-uniform one; reporting q_1 for every
  position (`FirstDistributionReported`), or drawing the whole block with one key (`OneKeyPerBlock`, the
  near-uniform draft), must give p < 1e-6 on 2,000 rows.
"""

import numpy as np
import pytest

from specjax.errors import ConfigError
from specjax.models.load import LoadedModel
from specjax.sampling import sampling_params
from specjax.speculative.drafters import registry
from specjax.speculative.drafters.base import DrafterSettings
from specjax.speculative.drafters.parallel import ParallelDrafter, load_mask_token, save_mask_token
from specjax.speculative.k_policy import Tables
from tests.helpers import engine
from tests.helpers.k_policy import COSTS_K3, POLICY
from tests.helpers.parallel import FirstDistributionReported, MaskEntriesKept, OneKeyPerBlock, run_parallel
from tests.helpers.stats import SAMPLE_ROWS

MASK = engine.VOCAB - 1  # any id of the draft's vocabulary serves a random draft
ALPHA, REJECTED = 1e-3, 1e-6
SAMPLED = sampling_params(0.7)
SAMPLE_K = 2
MUTANT_ROWS = 2_000  # enough to reject the mutant far below REJECTED (its p-value underflows to 0 at 10,000)


@pytest.fixture(scope="module")
def target_greedy():
  return engine.target_greedy()


def _tokens(out):
  return [list(map(int, row[:count])) for row, count in zip(np.asarray(out.tokens), np.asarray(out.counts))]


@pytest.mark.parametrize("draft", ["same", "perturbed", "independent"])
def test_greedy_output_equals_the_targets_with_one_draft_pass_per_round(draft, target_greedy):
  out = run_parallel(engine.DRAFTS[draft], MASK)
  assert _tokens(out) == target_greedy
  assert int(out.draft_calls) == int(out.target_calls) - 1  # one pass per round, whatever K


def test_adaptive_policy_greedy_output_equals_the_targets(target_greedy):
  """Fast-moving estimates and costs that make long proposals pay only while acceptance stays high: the
  rounds propose 0 (a plain step: the pass still feeds the lag and pending) to K tokens."""
  out = run_parallel(engine.DRAFTS["perturbed"], MASK, policy=POLICY, tables=Tables(COSTS_K3))
  assert _tokens(out) == target_greedy
  assert int(out.draft_calls) == int(out.target_calls) - 1
  assert int(np.asarray(out.rounds_per_length)[:-1].sum()) > 0  # some rounds proposed fewer than K


def _first_position_misses(cls):
  acceptance = run_parallel(engine.DRAFTS["same"], MASK, cls=cls).acceptance
  return int(np.sum(np.asarray(acceptance.reached_at)[:, 0] - np.asarray(acceptance.accepted_at)[:, 0]))


def test_history_holds_real_ids_not_masks():
  """The target as its own draft: q_1 is the target's distribution, every first draft token is accepted;
  a cache that keeps the masks' entries misses some."""
  assert _first_position_misses(ParallelDrafter) == 0
  assert _first_position_misses(MaskEntriesKept) > 0


# A near-uniform draft: q_1 and q_2 alike, so that one key for the whole block draws d_2 = d_1 almost always
# (with SMALL_DRAFT the two distributions differ enough that such a draw passed at 5,000 rows, p 0.27).
FLAT_DRAFT = engine.tiny_model(12, vocab=8, n_layers=2, scale=0.02)


def _sampled(cls, rows, draft=engine.SMALL_DRAFT):
  out = run_parallel(draft, engine.SMALL_TARGET[0].vocab_size - 1, k=SAMPLE_K, cls=cls, target=engine.SMALL_TARGET,
                     prompts=[engine.SAMPLE_PROMPT] * rows, budgets=SAMPLE_K + 2, sampling=SAMPLED, seed=1,
                     cache_len=16, out_width=None)
  return np.asarray(out.tokens)


def test_sampled_tokens_follow_the_exact_target_distribution():
  assert engine.first_tokens_pvalue(engine.SMALL_TARGET, engine.SAMPLE_PROMPT, SAMPLED,
                                    _sampled(ParallelDrafter, SAMPLE_ROWS)) > ALPHA
  assert engine.first_tokens_pvalue(engine.SMALL_TARGET, engine.SAMPLE_PROMPT, SAMPLED,
                                    _sampled(FirstDistributionReported, MUTANT_ROWS)) < REJECTED
  # One key for every draw of a block: this drafter's own test rejects it (not only the DFlash test, which
  # shares draw_block); the truthful drafter passes with the same draft.
  assert engine.first_tokens_pvalue(engine.SMALL_TARGET, engine.SAMPLE_PROMPT, SAMPLED,
                                    _sampled(ParallelDrafter, SAMPLE_ROWS, FLAT_DRAFT)) > ALPHA
  assert engine.first_tokens_pvalue(engine.SMALL_TARGET, engine.SAMPLE_PROMPT, SAMPLED,
                                    _sampled(OneKeyPerBlock, MUTANT_ROWS, FLAT_DRAFT)) < REJECTED


def test_mask_token_from_the_draft_directory_or_the_config(tmp_path):
  cls = registry.resolve("parallel")
  assert cls is ParallelDrafter
  save_mask_token(str(tmp_path), 7)
  assert load_mask_token(str(tmp_path)) == 7
  loaded = engine.TARGET
  same_tokenizer = type("Tokenizer", (), {"fingerprint": lambda self, below=None: "one"})()
  draft = LoadedModel("draft", *loaded, tokenizer=same_tokenizer)
  options = cls.config_group()
  settings = DrafterSettings("parallel", options, draft=str(tmp_path), k=3)
  drafter, facts = cls.build(settings, draft, draft)
  assert (drafter.mask_id, drafter.k, facts) == (7, 3, {"parallel_mask_token_id": 7})
  with pytest.raises(ConfigError, match="config.parallel.mask_token_id"):
    cls.build(DrafterSettings("parallel", options, draft=str(tmp_path / "none"), k=3), draft, draft)
  with pytest.raises(ValueError, match="mask token 61"):
    ParallelDrafter(*loaded, 61, 3).check(loaded[0])
  # Out of the draft's vocabulary: a config error (exit 2) naming the field, before anything compiles.
  outside = options.copy_and_resolve_references()
  outside.mask_token_id = loaded[0].vocab_size
  with pytest.raises(ConfigError, match=f"config.parallel.mask_token_id: mask token {loaded[0].vocab_size} lies"):
    cls.build(DrafterSettings("parallel", outside, draft=str(tmp_path), k=3), draft, draft)
