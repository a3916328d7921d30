"""Cost of a T-token forward pass relative to a 1-token step, under several XLA CPU settings.

Speculative decoding on a CPU is limited by the verify pass (K + 1 tokens at once): this measures
T = 1..9 for the target's shape (Qwen2.5-Coder-1.5B dimensions, random weights, float32; `layers`
trims the depth to keep the run short; the head is full size) in one subprocess per XLA setting, so
that every variant runs on the same machine in one run. Writes a JSON result.

  python -m experiments.forward_cost --config=configs/benchmarks/forward_cost.py
"""

from __future__ import annotations

import json
import os

import ml_collections

from experiments import harness
from specjax import records
from specjax.errors import ConfigError

CONFIG_FILE = "configs/benchmarks/forward_cost.py"  # the config of the subprocesses

VARIANTS = {
    "default": "",
    "xnnpack": "--xla_cpu_use_xnnpack=true",
    "onednn": "--xla_cpu_use_onednn=true",
    "no_thunks": "--xla_cpu_use_thunk_runtime=false",
}


def measure(layers: int, tokens: list[int], repeats: int, cache_len: int) -> dict[int, float]:
  """Median seconds of one jitted forward of T tokens at a cache offset of 100."""
  import numpy as np

  from specjax import costs
  from specjax.models.config import ModelConfig
  from specjax.models.param_tree import assemble_params, expected_shapes

  config = ModelConfig(arch="llama", vocab_size=151936, d_model=1536, n_layers=layers, n_heads=12,
                       n_kv_heads=2, head_dim=128, d_ff=8960, qkv_bias=True, rope_theta=1e6)
  rng = np.random.default_rng(0)
  params = assemble_params(config, {path: rng.standard_normal(shape, dtype=np.float32) * 0.02
                                    for path, shape in expected_shapes(config).items()}, "random")

  return costs.forward_seconds(config, params, tokens, repeats, cache_len=cache_len)


def run(cfg: ml_collections.ConfigDict, log: harness.Log = print) -> dict:
  """Measures every variant of `cfg` in its own subprocess; returns the results, also written to
  `cfg.output` unless it is empty."""
  results = {"command": records.command(), "layers": cfg.layers, "cache_len": cfg.cache_len, "variants": {}}
  for name in cfg.variants:
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + VARIANTS[name]).strip())
    measured, stderr = harness.run_child("experiments.forward_cost", CONFIG_FILE,
                                         {"child": name, "layers": cfg.layers, "repeats": cfg.repeats,
                                          "cache_len": cfg.cache_len}, env)
    if measured is None:
      results["variants"][name] = {"flags": VARIANTS[name], "error": stderr[-2000:]}
      log(f"{name}: failed\n{stderr[-2000:]}")
      continue
    seconds = {int(t): s for t, s in measured.items()}
    ratio = {t: s / seconds[1] for t, s in seconds.items()}
    results["variants"][name] = {"flags": VARIANTS[name], "seconds": seconds, "ratio_to_T1": ratio}
    log(f"{name:10s} T=1 {seconds[1] * 1e3:7.1f} ms  ratios " + " ".join(f"{t}:{r:.2f}" for t, r in ratio.items()))
  if cfg.output:
    harness.write_results(results, cfg.output)
  return results


def main(cfg: ml_collections.ConfigDict) -> None:
  if cfg.child:  # a subprocess of `run`, whose XLA_FLAGS select the variant
    print(json.dumps(measure(cfg.layers, list(range(1, 10)), cfg.repeats, cfg.cache_len)))
    return
  unknown = [name for name in cfg.variants if name not in VARIANTS]
  if unknown:
    raise ConfigError(f"config.variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
  run(cfg, log=harness.log)


if __name__ == "__main__":
  harness.run_script(main, "Benchmark config (configs/benchmarks/forward_cost.py).")
