"""The DFlash drafter (`drafters/dflash.py`): a block head on the target's features fills K draft tokens
in one non-causal pass per round.

- Greedy output equals the target's own greedy decoding for a ragged batch (budgets not multiples of
  the block) at K = 3 and 6, EAGLE-3 and final-hidden-state features, and under the adaptive K policy;
  the head runs exactly one pass per round that drafts, whatever K (`draft_calls`).
- Sampled at T = 0.7 (top-k 5), the first 3 tokens (K = 2) follow the target's exact distribution:
  chi-square at level 0.001 on N = 10,000 rows of one call (fixed seed); reporting q_1 for every block
  position while drawing d_i from q_i (`FirstDistributionReported`) must give p < 1e-6 on the same rows.
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
from specjax.speculative.k_policy import Adaptive
from specjax.speculative.trees import tree as tree_lib
from tests.helpers.dflash import FirstDistributionReported, dflash_drafter
from tests.helpers.eagle import eagle_head, run_eagle
from tests.helpers.engine import SAMPLE_PROMPT, first_tokens_pvalue
from tests.helpers.layer_skip import SMALL_TARGET, TARGET, target_greedy_3
from tests.helpers.stats import SAMPLE_ROWS

ALPHA, REJECTED = 1e-3, 1e-6
SAMPLE_K = 2  # the first K + 2 tokens: the prefill's, d_1, d_2, then the bonus or a correction


@pytest.mark.parametrize("k, feature_layers", [(3, (0, 1, 2)), (6, ())])
def test_greedy_equals_target_greedy_with_one_pass_per_round(k, feature_layers):
  out = run_eagle(TARGET, dflash_drafter(TARGET, feature_layers), k)
  assert as_token_lists(out.tokens, out.counts) == target_greedy_3()
  total = metrics.summarize(out.acceptance)["total"]
  assert total["proposed"] > 0 and total["accepted"] < total["proposed"]
  assert int(out.draft_calls) == int(jnp.max(out.acceptance.rounds))  # one pass per round, whatever K


def test_adaptive_policy_greedy_equals_target_greedy():
  """Costs that make long proposals pay only while acceptance stays high: rounds propose 0 (a plain
  step: no head pass) to K tokens, and the head runs once per round that drafts."""
  out = run_eagle(TARGET, dflash_drafter(TARGET), 3, policy=Adaptive(prior=0.8, decay=0.5, recovery=0.3),
                  cost_C=np.array([1.0, 1.5, 1.9, 2.2], np.float32))
  assert as_token_lists(out.tokens, out.counts) == target_greedy_3()
  per_length = np.asarray(out.rounds_per_length)
  assert per_length[0] > 0  # some plain rounds
  assert int(out.draft_calls) == int(per_length[1:].sum())


def _sampled(cls, final_scale, rows=SAMPLE_ROWS, seed=2):
  drafter = dflash_drafter(SMALL_TARGET, seed=4, final_scale=final_scale, cls=cls)
  sampling = sampling_params(0.7, top_k=5)
  out = run_eagle(SMALL_TARGET, drafter, SAMPLE_K, prompts=[SAMPLE_PROMPT] * rows, budgets=SAMPLE_K + 2,
                  sampling=sampling, seed=seed, out_width=SAMPLE_K + 2, cache_len=len(SAMPLE_PROMPT) + SAMPLE_K + 4)
  return first_tokens_pvalue(SMALL_TARGET, SAMPLE_PROMPT, sampling, out.tokens), out


def test_sampled_tokens_follow_the_exact_target_distribution():
  pvalue, out = _sampled(DFlashDrafter)
  at = metrics.summarize(out.acceptance)
  assert pvalue > ALPHA
  assert 0.1 < at["total"]["acceptance_rate"] < 0.95
  mutant_pvalue, _ = _sampled(FirstDistributionReported)
  assert mutant_pvalue < REJECTED


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
