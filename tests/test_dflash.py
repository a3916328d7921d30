"""The DFlash drafter (`drafters/dflash.py`): a block head on the target's features fills K draft tokens
in one non-causal pass per round.

- Greedy output equals the target's own greedy decoding for a ragged batch (budgets not multiples of
  the block) at K = 3 and 6 and under the adaptive K policy, with a briefly trained head (whose blocks
  are accepted in part, up to their second slot at least); the head runs exactly one pass per round that
  drafts, whatever K (`draft_calls`).
- Sampled at T = 0.7 (top-k 5), the first K + 2 = 4 tokens (K = 2: the prefill's, d_1, d_2, the bonus
  or a correction) follow the target's exact distribution: chi-square at level 0.001 on N = SAMPLE_ROWS rows
  of one call (fixed seed), with a briefly trained head; reporting q_1 for every block position while
  drawing d_i from q_i (`FirstDistributionReported`) must give p < 1e-6 on the same number of rows (it
  gave 2e-84; at 2,000 rows only 0.15).
- Heads without a mask embedding, trees and a missing head directory fail early, naming the field.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import metrics
from specjax.errors import ConfigError
from specjax.generation import as_token_lists
from specjax.sampling import sampling_params
from specjax.speculative.drafters import registry
from specjax.speculative.drafters.base import DrafterSettings
from specjax.speculative.drafters.dflash import DFlashDrafter
from specjax.speculative.drafters.eagle_io import save_head
from specjax.speculative.k_policy import Tables
from specjax.speculative.trees import tree as tree_lib
from tests.helpers.dflash import FirstDistributionReported, trained_dflash_drafter
from tests.helpers.eagle import eagle_head, run_eagle
from tests.helpers.engine import SAMPLE_PROMPT, first_tokens_pvalue, target_greedy
from tests.helpers.k_policy import COSTS_K3, POLICY
from tests.helpers.layer_skip import SMALL_TARGET, TARGET
from tests.helpers.tiny_hf import save_hf_model
from tests.helpers.stats import SAMPLE_ROWS

ALPHA, REJECTED = 1e-3, 1e-6
SAMPLE_K = 2  # the first K + 2 tokens: the prefill's, d_1, d_2, then the bonus or a correction

PROMPTS = [[3, 1, 4], [1, 5, 2, 6, 5, 3], [7]]  # ragged, in the small target's vocabulary of 8
BUDGETS = [9, 14, 11]  # not multiples of the blocks


@pytest.fixture(scope="module")
def trained():
  return trained_dflash_drafter(SMALL_TARGET)


def _greedy(drafter, k, **kwargs):
  """(the target's own greedy tokens, the DFlash drafter's, its output) for `PROMPTS`."""
  out = run_eagle(SMALL_TARGET, drafter, k, prompts=PROMPTS, budgets=BUDGETS, **kwargs)
  return target_greedy(PROMPTS, BUDGETS, target=SMALL_TARGET), as_token_lists(out.tokens, out.counts), out


@pytest.mark.parametrize("k", [3, 6])
def test_greedy_equals_target_greedy_with_one_pass_per_round(trained, k):
  plain, speculative, out = _greedy(trained, k)
  assert speculative == plain
  total = metrics.summarize(out.acceptance)["total"]
  assert total["accepted_at_position"][1] > 0 and total["accepted"] < total["proposed"]  # blocks kept in part
  assert int(out.draft_calls) == int(jnp.max(out.acceptance.rounds))  # one pass per round, whatever K


def test_adaptive_policy_greedy_equals_target_greedy(trained):
  """Costs that make long proposals pay only while acceptance stays high: rounds propose 0 (a plain
  step: no head pass) to K tokens, and the head runs once per round that drafts."""
  plain, speculative, out = _greedy(trained, 3, policy=POLICY, tables=Tables(COSTS_K3))
  assert speculative == plain
  per_length = np.asarray(out.rounds_per_length)
  assert per_length[0] > 0 and per_length[1:].sum() > 0  # plain rounds and drafting rounds
  assert int(out.draft_calls) == int(per_length[1:].sum())


def _sampled(drafter, cls, rows):
  sampling = sampling_params(0.7, top_k=5)
  drafter = cls(drafter.config, drafter.params, *SMALL_TARGET)
  out = run_eagle(SMALL_TARGET, drafter, SAMPLE_K, prompts=[SAMPLE_PROMPT] * rows, budgets=SAMPLE_K + 2,
                  sampling=sampling, seed=2, out_width=SAMPLE_K + 2, cache_len=len(SAMPLE_PROMPT) + SAMPLE_K + 4)
  return first_tokens_pvalue(SMALL_TARGET, SAMPLE_PROMPT, sampling, out.tokens), out


def test_sampled_tokens_follow_the_exact_target_distribution(trained):
  """A briefly trained head (`trained_dflash_drafter`: d_1 accepted often, q_2 unlike q_1), so that a
  wrong distribution reported for slot 2 shows in the output."""
  pvalue, out = _sampled(trained, DFlashDrafter, SAMPLE_ROWS)
  assert pvalue > ALPHA
  assert 0.15 < metrics.summarize(out.acceptance)["total"]["acceptance_rate"] < 0.95
  assert _sampled(trained, FirstDistributionReported, SAMPLE_ROWS)[0] < REJECTED


def test_heads_and_settings_that_cannot_work_fail_early(tmp_path):
  cls = registry.resolve("dflash")
  assert cls is DFlashDrafter
  options = cls.config_group()
  with pytest.raises(ConfigError, match="config.draft is empty"):
    cls.check_config(DrafterSettings("dflash", options))
  with pytest.raises(ConfigError, match="config.tree"):
    cls.check_config(DrafterSettings("dflash", options, draft="x", tree=tree_lib.chain(2)))
  config, params = eagle_head(TARGET[0], (0, 1, 2))  # an EAGLE head: no mask embedding
  save_head(str(tmp_path), config, params)
  target = type("Loaded", (), {"config": TARGET[0], "params": TARGET[1], "part": None})()
  with pytest.raises(ConfigError, match="not a DFlash head"):
    cls.build(DrafterSettings("dflash", options, draft=str(tmp_path), k=3), target, None)
  with pytest.raises(ValueError, match="mask/embedding"):
    DFlashDrafter(config, params, *TARGET).check(TARGET[0])
  model_dir = tmp_path / "model"  # a plain model directory: not called an EAGLE-3 head
  save_hf_model("llama", str(model_dir))
  with pytest.raises(ValueError, match=r"a model directory \(llama with 2 layers\), not a draft head"):
    cls.build(DrafterSettings("dflash", options, draft=str(model_dir), k=3), target, None)
