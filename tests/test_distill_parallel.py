"""PARD distillation (`student.init = "parallel"`, `specjax.distill.pard`): the training layout shows each
mask what the decode pass shows it; 20 steps of the tiny config raise the held-out greedy agreement at
draft positions >= 2 from about 0 (< 0.1) to clearly above (> 0.15), the exported draft decodes exactly
as `drafter = "parallel"` (one pass per round), and a run killed after a checkpoint resumes bit for bit
(one test: the uninterrupted run serves both).

The layout check compares the student's logits at every node of a COD layout with a plain causal forward
of [x_1 .. x_a, MASK x j] (what `ParallelDrafter` feeds); its mutant, masks that follow the real tokens
after their anchor (seeing the future they must predict), must differ.
"""

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from configs import distill_tiny_parallel
from specjax import testing
from specjax.distill import pard, train
from specjax.errors import ConfigError
from specjax.models.load import load_model
from specjax.speculative.drafters.base import DrafterSettings
from specjax.speculative.drafters.parallel import MASK_FILE, ParallelDrafter
from tests.helpers.distill import distill_config, killed_and_resumed, read_records
from tests.helpers.distill import target  # noqa: F401 (the fixture)
from tests.helpers.engine import tiny_model

SEQ_LEN, K = 12, 4
SHORT = dict(num_steps=20, eval_every=20)  # the tiny config's first 20 steps (checkpoints every 10)


def _layout_error(layout):
  """The largest difference between the layout's node logits and a plain causal forward of each node's
  context [x_1 .. x_a, MASK x j] (all contexts in one forward, right-padded: causal, so the padding is
  never seen)."""
  config, params = pard.with_mask_row(*tiny_model(0))
  mask_id = pard.mask_id(config)
  tokens_BxT = np.random.default_rng(0).integers(0, mask_id, (2, SEQ_LEN)).astype(np.int32)
  nodes_BxNxW = np.asarray(layout.student_logits(config, params, jnp.asarray(tokens_BxT)))
  contexts_NxBxC = np.zeros((len(layout.step), 2, SEQ_LEN + K), np.int32)
  for node, (j, source) in enumerate(zip(layout.step, layout.source)):
    contexts_NxBxC[node, :, :source + 1] = np.concatenate([tokens_BxT[:, :source - j + 1],
                                                           np.full((2, j), mask_id)], axis=1)
  plain_ZxCxW = np.asarray(pard.PlainLayout().student_logits(config, params,
                                                             jnp.asarray(contexts_NxBxC.reshape(-1, SEQ_LEN + K))))
  last_Z = np.repeat(np.asarray(layout.source), 2)  # each context's last position
  plain_NxBxW = plain_ZxCxW[np.arange(len(last_Z)), last_Z].reshape(len(layout.step), 2, -1)
  return float(np.abs(nodes_BxNxW.transpose(1, 0, 2) - plain_NxBxW).max())


def test_layout_shows_each_mask_its_anchors_context_only():
  layout = pard.pard_layout(SEQ_LEN, K, keep=0.7, mask_id=61)
  counts = [layout.step.count(j) for j in range(K)]
  assert counts[0] == SEQ_LEN and counts[1] > counts[2] > counts[3] > 0  # COD: fewer masks deeper
  assert _layout_error(layout) < 1e-4
  # Mutant: each mask follows the real token before its position instead of the mask above it.
  leaky = dataclasses.replace(
      layout, parent=tuple(p if s == 0 else src - 1 for p, s, src in zip(layout.parent, layout.step, layout.source)))
  assert _layout_error(leaky) > 1e-2


def test_parallel_draft_learns_later_positions_decodes_exactly_and_resumes_bit_identical(target, tmp_path):
  summary = train.run(distill_config(target, tmp_path / "whole", distill_tiny_parallel, **SHORT))
  before, after = summary["before"]["greedy_agreement_at"], summary["after"]["greedy_agreement_at"]
  assert len(before) == 3 and max(before[1:]) < 0.1  # the mask row knows nothing yet
  assert min(after[1:]) > 0.15 and summary["after"]["acceptance"] > summary["before"]["acceptance"]
  with open(os.path.join(summary["export_dir"], MASK_FILE)) as f:
    assert json.load(f)["mask_token_id"] == 97
  target_model, draft = load_model(target), load_model(summary["export_dir"])
  assert draft.config.vocab_size == target_model.config.vocab_size + 1
  drafter, _ = ParallelDrafter.build(
      DrafterSettings("parallel", ParallelDrafter.config_group(), draft=summary["export_dir"], k=3), target_model,
      draft)
  prompts = [target_model.tokenizer.encode(text) for text in ("def main(args):\n    ", "import os\nimport ")]
  out = testing.check_greedy(drafter, (target_model.config, target_model.params), prompts, k=drafter.k,
                             max_new_tokens=24, cache_len=64)
  assert int(out.draft_calls) == int(out.target_calls) - 1

  # Killed at step 15, after the checkpoint of step 10.
  resumed = killed_and_resumed(lambda: distill_config(target, tmp_path / "resumed", distill_tiny_parallel, **SHORT), 15)
  assert read_records(tmp_path / "resumed") == read_records(tmp_path / "whole") and resumed["after"] == summary["after"]
  want = load_file(os.path.join(summary["export_dir"], "model.safetensors"))
  got = load_file(os.path.join(resumed["export_dir"], "model.safetensors"))
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_parallel_config_errors_name_the_field(target, tmp_path):
  config = distill_config(target, tmp_path, distill_tiny_parallel)
  config.data.modes.student = 1.0
  with pytest.raises(ConfigError, match="student.init 'parallel'.*data.modes.student"):
    train.run(config)
  with pytest.raises(ConfigError, match="student.parallel_k >= 2"):
    train.run(distill_config(target, tmp_path, distill_tiny_parallel, student=dict(config.student, parallel_k=1)))
