"""`specjax.lowering`: the loops, kernels and host transfers of a decode program lowered for a platform
that is not here (CUDA), counted from its StableHLO.

The counts are checked against what the programs are known to hold: the blockwise live-length attention
is one data-dependent `fori_loop` per layer of every pass (so an autoregressive step of an L-layer model
holds L), dense attention none; the model drafter's draft loop is the one data-dependent loop a dense
speculative round holds; a scan over layers is a loop of constant trip count and is not counted; the
prefill's loops sit outside the round. Kernel attention leaves no loop per layer: with narrow passes off
the round holds the draft loop alone, whatever the depth. The CLI's `lower_only` writes one entry per
program (for CUDA: the kernel round).
"""

import dataclasses
import json

import jax
import pytest

from specjax import autoregressive, lowering, testing
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import init_params
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.loop import SpeculativeLoop
from tests.helpers.cli import decode_in_process, model_dirs  # noqa: F401 (the fixture)
from tests.helpers.engine import tiny_model

LAYERS, DRAFT_LAYERS, CACHE_LEN = 3, 2, 40
TARGET, DRAFT = tiny_model(0, n_layers=LAYERS), tiny_model(1, n_layers=DRAFT_LAYERS)
PROMPTS = [[5, 17, 3], [1, 2, 9, 4]]
TRITON = "__gpu$xla.gpu.triton"  # the custom call of a Pallas GPU kernel


def _autoregressive_report(config, params):
  lowered = autoregressive.generate(config, params, testing.request(PROMPTS, 4), init_cache(config, 2, CACHE_LEN),
                                    lower="cuda")
  return lowering.report(lowered)


def _speculative_report(block, target=TARGET, draft=DRAFT, **execution):
  config = dataclasses.replace(target[0], attention_block=block, **execution)
  drafter = ModelDrafter(dataclasses.replace(draft[0], attention_block=block, **execution), draft[1], None)
  lowered = testing.speculate(SpeculativeLoop(config, 3), target[1], drafter, testing.request(PROMPTS, 6),
                              cache_len=CACHE_LEN, lower="cuda")
  return lowering.report(lowered)


@pytest.mark.parametrize("block, in_round", [(0, 0), (16, LAYERS)])
def test_autoregressive_step_holds_one_loop_per_layer_with_blockwise_attention(block, in_round):
  report = _autoregressive_report(dataclasses.replace(TARGET[0], attention_block=block), TARGET[1])
  assert report["while_loops_in_round"] == in_round
  # The prefill's attention loops (one per layer) and the round loop itself are outside the round.
  assert report["data_dependent_while_loops"] == 1 + 2 * in_round
  assert report["host_transfers"] == 0 and report["custom_calls"] == {}


def test_a_scan_over_layers_is_not_a_data_dependent_loop():
  config = dataclasses.replace(TARGET[0], attention_block=0, scan_layers=True)
  report = _autoregressive_report(config, init_params(config, jax.random.key(0)))
  assert report["while_loops"] > report["data_dependent_while_loops"] == 1
  assert report["while_loops_in_round"] == 0 and report["max_nesting"] == 2  # the layer scan in the step loop


def test_speculative_round_counts_the_draft_loop_and_every_blockwise_layer():
  dense, blockwise = _speculative_report(0), _speculative_report(16)
  # The draft loop, and the draft's catch-up pass of one or two tokens: `inplace.cond`, a loop of zero or
  # one trip per branch (a `lax.cond` writing the cache would copy it).
  assert dense["while_loops_in_round"] == 3
  # Each round: K draft passes (a loop: their layers appear once), the verify pass of every compiled
  # width, each a blockwise loop per layer.
  assert blockwise["while_loops_in_round"] >= 1 + DRAFT_LAYERS + LAYERS
  assert blockwise["max_nesting"] >= 3


@pytest.mark.parametrize("layers, draft_layers", [(LAYERS, DRAFT_LAYERS), (6, 4)])
def test_the_kernel_round_holds_only_the_draft_loop_whatever_the_depth(layers, draft_layers):
  """Kernel attention: no loop per layer; with narrow passes off, no catch-up branch either: the draft
  loop alone. The kernel is a Triton custom call; nothing goes to the host."""
  target, draft = tiny_model(0, n_layers=layers), tiny_model(1, n_layers=draft_layers)
  branch_free = _speculative_report(16, target, draft, attention="kernel", narrow_passes=False)
  assert branch_free["while_loops_in_round"] == 1 and branch_free["host_transfers"] == 0
  assert branch_free["custom_calls"].get(TRITON, 0) >= layers + draft_layers
  # Narrow passes on: the catch-up's two widths, each a loop of zero or one trip (`inplace.switch`).
  assert _speculative_report(16, target, draft, attention="kernel")["while_loops_in_round"] == 3
  step = _autoregressive_report(target[0].replace(attention="kernel"), target[1])
  assert step["while_loops_in_round"] == 0 and step["data_dependent_while_loops"] == 1  # the step loop


def test_cli_lower_only_writes_the_report_without_decoding(model_dirs, tmp_path):
  out = tmp_path / "report.json"
  status, stderr = decode_in_process([
      "--config=configs/tiny.py", f"--config.target={model_dirs[0]}", f"--config.draft={model_dirs[1]}",
      "--config.lower_only=cuda", f"--config.output={out}"
  ])
  assert status == 0, stderr[-2000:]
  results = json.loads(out.read_text())
  assert "outputs" not in results and "stats" not in results
  [program] = results["programs"]
  assert program["name"] == "speculative" and program["platform"] == "cuda"
  # attention and narrow_passes "auto" resolve for CUDA: the kernel, one width per pass.
  assert program["while_loops_in_round"] == 1 and program["host_transfers"] == 0
  assert TRITON in program["custom_calls"]
