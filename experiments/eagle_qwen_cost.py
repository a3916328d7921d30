"""What an EAGLE-3 head for Qwen2.5-Coder-1.5B costs, against the 0.5B draft: drafting and training.

  python -m experiments.eagle_qwen_cost --config=configs/benchmarks/eagle_qwen_cost.py

Measures, on this machine, in one run (float32, random head weights: costs do not depend on training):
- c, one draft pass over one target step (`costs.cost_ratio`, 1-token forwards with 100 tokens cached),
  at batch 1 and 4, for the 0.5B draft model and for a head (one target-sized block and the output
  head, as `EagleDrafter.draft_pass` times it) through the full 151,936-token head and through the
  32,768 tokens most frequent in the standard library's sources (`draft_vocab`);
- one training step of the head (`distill.eagle_steps`: target features and logits, the 4-step
  training-time test, AdamW) on `batch` rows of 256 tokens: seconds per step after compilation.
It then writes what 1,200 such steps of 4 x 256 tokens (the SmolLM2 run's recipe) would take here, and
a GPU estimate from the step's floating-point operations at an assumed sustained rate (`gpu_tflops`,
an assumption, stated in the output). No acceptance is measured: a head that is not trained has none.
"""

from __future__ import annotations

import json
import time

import jax
import ml_collections
import numpy as np

from experiments import harness
from specjax import costs, records
from specjax.speculative.drafters.base import DraftPass
from specjax.speculative.drafters.draft_head import restricted_draft_head
from specjax.distill import eagle_steps, steps as train_steps
from specjax.distill.config import default_config
from specjax.distill.student import TRAIN
from specjax.errors import ConfigError
from specjax.models.load import load_model
from specjax.speculative.drafters.eagle_head import eagle3_layers, head_config, init_head_params

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
SEQ_LEN, TTT_STEPS = 256, 4  # the SmolLM2 run's rows and unroll
RUN_STEPS, RUN_ROWS = 1200, 4  # the SmolLM2 run's recipe, for the projection


def train_step_flops(target_params: int, block_params: int, fc_params: int, vocab: int, d_model: int, tokens: int,
                     ttt_steps: int) -> float:
  """Floating-point operations of one step: the target forward (2 per parameter and token), and per TTT
  step the head block's forward and backward (6 per parameter and token) and the shared output head's
  forward and input gradient (4 per vocabulary row x width and token); the fc once (6 per parameter)."""
  per_token = 2 * target_params + 6 * fc_params + ttt_steps * (6 * block_params + 4 * vocab * d_model)
  return float(per_token) * tokens


def time_train_step(target, head, batch: int, repeats: int) -> dict:
  """Seconds of one jitted training step of `head` (config, params) on [batch, SEQ_LEN] stdlib-like ids."""
  config, params = head
  labels = jax.tree.map(lambda _: TRAIN, params)
  optimizer, schedule = train_steps.make_optimizer(default_config().optim, RUN_STEPS, labels)
  state = train_steps.init_state(params, optimizer, seed=0)
  step = eagle_steps.make_train_step(config, target.config, optimizer, schedule, TTT_STEPS)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, target.config.vocab_size, (batch, SEQ_LEN), dtype=np.int32)
  mask = np.ones((batch, SEQ_LEN), bool)
  start = time.perf_counter()
  state, metrics = step(state, target.params, tokens, mask)
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - start
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    state, metrics = step(state, target.params, tokens, mask)
    jax.block_until_ready(metrics)
    seconds.append(time.perf_counter() - start)
  return {
      "rows": batch, "seq_len": SEQ_LEN, "ttt_steps": TTT_STEPS, "first_call_s": compile_s,
      "step_s": float(np.median(seconds)), "step_s_runs": seconds
  }


def run(cfg: ml_collections.ConfigDict, log: harness.Log = print) -> dict:
  """Measures the costs (module docstring); returns the results, also written to `cfg.output`."""
  if not cfg.output:
    raise ConfigError("config.output is empty: name the results file")
  target, draft = load_model(TARGET), load_model(DRAFT)
  layers = eagle3_layers(target.config.n_layers)
  config = head_config(target.config, layers)
  params = init_head_params(config, jax.random.key(0))
  restricted, coverage = restricted_draft_head(cfg.draft_vocab, "stdlib", target, target)
  ratios = {}
  for batch in (1, 4):
    ratios[batch] = {
        "draft_0.5b": costs.cost_ratio(target.config, target.params, DraftPass(draft.config, draft.params), batch,
                                       cfg.repeats),
        "head_full_vocab": costs.cost_ratio(target.config, target.params,
                                            DraftPass(target.config, target.params, layers=(0,)), batch, cfg.repeats),
        f"head_{cfg.draft_vocab}_vocab": costs.cost_ratio(target.config, target.params,
                                                          DraftPass(target.config, target.params, restricted, (0,)),
                                                          batch, cfg.repeats)
    }
    log(f"batch {batch}: c = " + ", ".join(f"{k} {v:.3f}" for k, v in ratios[batch].items()))
  count = lambda tree: int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
  head_params, fc_params = count(params), count(params.get("fc", {}))
  training = time_train_step(target, (config, params), cfg.batch, repeats=2)
  log(f"training step, {cfg.batch} x {SEQ_LEN} tokens: {training['step_s']:.1f} s")
  flops = train_step_flops(target.config.num_params(), head_params - fc_params, fc_params, target.config.vocab_size,
                           target.config.d_model, cfg.batch * SEQ_LEN, TTT_STEPS)
  run_flops = flops / (cfg.batch * SEQ_LEN) * RUN_ROWS * SEQ_LEN * RUN_STEPS
  result = {
      "command": records.command(), "environment": records.environment(), "target": TARGET, "draft": DRAFT, "head": {
          "feature_layers": list(layers), "trained_params": head_params,
          "shared_output_head_rows": target.config.vocab_size
      }, "draft_vocab": {"size": cfg.draft_vocab,
                         "stdlib_token_coverage": coverage}, "cost_ratio_c": ratios, "training_step": training,
      "training_step_tflop": flops / 1e12, "measured_tflops": flops / 1e12 / training["step_s"],
      "run_recipe": {"steps": RUN_STEPS, "rows": RUN_ROWS, "seq_len": SEQ_LEN, "ttt_steps": TTT_STEPS},
      "run_hours_here": training["step_s"] * RUN_ROWS / cfg.batch * RUN_STEPS / 3600, "run_tflop": run_flops / 1e12,
      "gpu_estimate": {
          "assumed_tflops": cfg.gpu_tflops, "minutes": run_flops / 1e12 / cfg.gpu_tflops / 60,
          "note": "an estimate from operation counts, not a measurement"
      }
  }
  harness.write_results(result, cfg.output)
  return result


def main(cfg: ml_collections.ConfigDict) -> None:
  result = run(cfg, log=harness.log)
  print(
      json.dumps({k: result[k] for k in ("cost_ratio_c", "run_hours_here", "measured_tflops", "gpu_estimate")},
                 indent=1))


if __name__ == "__main__":
  harness.run_script(main, "Benchmark config (configs/benchmarks/eagle_qwen_cost.py).")
