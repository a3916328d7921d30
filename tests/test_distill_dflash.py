"""DFlash distillation (`student.init = "dflash_head"`, `specjax.distill.dflash_steps`): training shows each
anchor's block what the decode pass shows it; 20 steps of the tiny config raise the held-out expected
acceptance and greedy agreement at block slots >= 2, the exported head decodes exactly as
`drafter = "dflash"` (one pass per round), and a run killed after a checkpoint resumes bit for bit (one
test: the uninterrupted run serves both).

The layout check compares the training pass's block logits at anchors 1, 4 and 7 of a row with the
drafter's own pass after a prefill of x_0 .. x_{a-1} (pending x_a); its mutant, blocks that also see the
context pair of their own first slot (c <= a - 1: one pair of the future), must differ.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from configs import distill_tiny_dflash
from specjax import testing
from specjax.distill import dflash_steps, train
from specjax.errors import ConfigError
from specjax.models.kv_cache import init_cache
from specjax.models.load import load_model
from specjax.models.transformer import forward_features
from specjax.speculative.drafters.base import DrafterSettings
from specjax.speculative.drafters.dflash import DFlashDrafter
from specjax.speculative.drafters.eagle_io import WEIGHTS_FILE
from tests.helpers.dflash import dflash_drafter
from tests.helpers.distill import distill_config, killed_and_resumed, read_records
from tests.helpers.distill import target  # noqa: F401 (the fixture)
from tests.helpers.layer_skip import TARGET

SEQ_LEN, K = 10, 3
ANCHORS = (1, 4, 7)
SHORT = dict(num_steps=20, eval_every=20)  # the tiny config's first 20 steps (checkpoints every 10)


def _layout_error():
  """The largest difference between the training pass's block logits and the drafter's at `ANCHORS`."""
  drafter = dflash_drafter(TARGET)
  config, (target_config, target_params) = drafter.config, TARGET
  tokens_1xT = jnp.asarray(np.random.default_rng(0).integers(0, target_config.vocab_size, (1, SEQ_LEN)), jnp.int32)
  _, features_1xTxF, _ = forward_features(target_config, target_params, tokens_1xT,
                                          init_cache(target_config, 1, SEQ_LEN), config.feature_layers)
  anchors_M = jnp.asarray(ANCHORS, jnp.int32)
  rows = len(ANCHORS)  # row m: history x_0 .. x_{a-1}, pending x_a

  @jax.jit
  def difference(drafter, tokens_1xT, features_1xTxF):
    trained_1xMxKxV = dflash_steps.block_logits(config, drafter.params, target_config, drafter.target_params,
                                                tokens_1xT, features_1xTxF, anchors_M[None], K)
    state = drafter.init_from_features(drafter.storage(rows, SEQ_LEN + K), jnp.repeat(tokens_1xT, rows, axis=0),
                                       anchors_M, jnp.repeat(features_1xTxF, rows, axis=0))
    drafted_MxKxV, _ = drafter.draft_block(state, tokens_1xT[0, anchors_M], K)
    return jnp.max(jnp.abs(trained_1xMxKxV[0] - drafted_MxKxV))

  return float(difference(drafter, tokens_1xT, features_1xTxF))


def test_training_blocks_see_what_the_drafting_block_sees(monkeypatch):
  assert _layout_error() < 1e-4
  honest = dflash_steps.anchor_layout

  def leaky(anchors_BxM, seq_len, block):  # each block also sees the context pair at its first slot's position
    layout = honest(anchors_BxM, seq_len, block)
    own_BxMK = jnp.repeat(anchors_BxM - 1, block, axis=1)
    context = seq_len - 1
    ancestors = layout.ancestors_BxNxN.at[:, context:, :context].set(layout.ancestors_BxNxN[:, context:, :context] | (
        jnp.arange(context)[None, None, :] == own_BxMK[:, :, None]))
    return layout.replace(ancestors_BxNxN=ancestors)

  monkeypatch.setattr(dflash_steps, "anchor_layout", leaky)
  assert _layout_error() > 1e-2


@pytest.mark.slow
def test_dflash_head_learns_later_slots_decodes_exactly_and_resumes_bit_identical(target, tmp_path):
  summary = train.run(distill_config(target, tmp_path / "whole", distill_tiny_dflash, **SHORT))
  before, after = summary["before"], summary["after"]
  assert len(after["acceptance_at"]) == K
  for j in (1, 2):  # block slots 2 and 3
    assert after["acceptance_at"][j] > before["acceptance_at"][j] + 0.1
    assert after["greedy_agreement_at"][j] > before["greedy_agreement_at"][j] + 0.1
  target_model = load_model(target)
  settings = DrafterSettings("dflash", DFlashDrafter.config_group(), draft=summary["export_dir"], k=K)
  drafter, facts = DFlashDrafter.build(settings, target_model, None)
  assert facts["eagle_feature_layers"] == [0, 1]
  prompts = [target_model.tokenizer.encode(text) for text in ("def main(args):\n    ", "import os\nimport ")]
  out = testing.check_greedy(drafter, (target_model.config, target_model.params), prompts, k=K, max_new_tokens=24,
                             cache_len=64)
  assert int(out.draft_calls) == int(jnp.max(out.acceptance.rounds))

  # Killed at step 15, after the checkpoint of step 10.
  resumed = killed_and_resumed(lambda: distill_config(target, tmp_path / "resumed", distill_tiny_dflash, **SHORT), 15)
  assert read_records(tmp_path / "resumed") == read_records(tmp_path / "whole") and resumed["after"] == after
  want = load_file(os.path.join(summary["export_dir"], WEIGHTS_FILE))
  got = load_file(os.path.join(resumed["export_dir"], WEIGHTS_FILE))
  assert "mask/embedding" in want and want.keys() == got.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_dflash_config_errors_name_the_field(target, tmp_path):
  config = distill_config(target, tmp_path, distill_tiny_dflash)
  config.student.dflash_block = 0
  with pytest.raises(ConfigError, match="student.dflash_block >= 1"):
    train.run(config)
  config = distill_config(target, tmp_path, distill_tiny_dflash)
  config.data.modes.student = 1.0
  with pytest.raises(ConfigError, match="student.init 'dflash_head'.*data.modes.student"):
    train.run(config)
