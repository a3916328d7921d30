"""Cost of a T-token forward pass relative to a 1-token step, for each weight-matmul backend and dtype.

Speculative decoding pays when verifying K + 1 tokens costs about one step. This times T = 1, 2, 3, 4,
6, 8 and 16 for the target's shape (Qwen2.5-Coder-1.5B dimensions, random weights; `layers` trims the depth to
keep the run short; the head is full size), one subprocess per variant (backend x dtype: see
`specjax.models.matmul`), so that every variant runs on the same machine in one run. Writes a JSON
result.

  python -m experiments.forward_cost --config=configs/benchmarks/forward_cost.py
"""

from __future__ import annotations

import json

import ml_collections

from experiments import harness
from specjax import records
from specjax.errors import ConfigError

CONFIG_FILE = "configs/benchmarks/forward_cost.py"  # the config of the subprocesses
TOKENS = (1, 2, 3, 4, 6, 8, 16)
VARIANTS = {  # name: (ModelConfig.matmul, dtype)
    "xla_float32": ("xla", "float32"),
    "kernel_float32": ("cpu_kernel", "float32"),
    "xla_bfloat16": ("xla", "bfloat16"),
    "kernel_bfloat16": ("cpu_kernel", "bfloat16"),
}


def measure(variant: str, layers: int, repeats: int, cache_len: int, offset: int) -> dict[int, float]:
  """Median seconds of one jitted forward of T tokens at `offset` cached positions, for every T."""
  import numpy as np

  from specjax import costs
  from specjax.models.config import ModelConfig
  from specjax.models.param_tree import assemble_params, expected_shapes

  backend, dtype = VARIANTS[variant]
  config = ModelConfig(arch="llama", vocab_size=151936, d_model=1536, n_layers=layers, n_heads=12, n_kv_heads=2,
                       head_dim=128, d_ff=8960, qkv_bias=True, rope_theta=1e6, dtype=dtype, matmul=backend)
  rng = np.random.default_rng(0)
  params = assemble_params(config, {
      path: rng.standard_normal(shape, dtype=np.float32) * 0.02 for path, shape in expected_shapes(config).items()
  }, "random")
  return costs.forward_seconds(config, params, TOKENS, repeats, cache_len=cache_len, offset=offset)


def run(cfg: ml_collections.ConfigDict, log: harness.Log = print) -> dict:
  """Measures every variant of `cfg` in its own subprocess; returns the results, also written to
  `cfg.output` unless it is empty."""
  results = {
      "command": records.command(), "environment": records.environment(), "layers": cfg.layers,
      "cache_len": cfg.cache_len, "offset": cfg.offset, "variants": {}
  }
  for name in cfg.variants:
    measured, stderr = harness.run_child("experiments.forward_cost", CONFIG_FILE, {
        "child": name, "layers": cfg.layers, "repeats": cfg.repeats, "cache_len": cfg.cache_len, "offset": cfg.offset
    })
    backend, dtype = VARIANTS[name]
    if measured is None:
      results["variants"][name] = {"matmul": backend, "dtype": dtype, "error": stderr[-2000:]}
      log(f"{name}: failed\n{stderr[-2000:]}")
      continue
    seconds = {int(t): s for t, s in measured.items()}
    ratio = {t: s / seconds[1] for t, s in seconds.items()}
    results["variants"][name] = {"matmul": backend, "dtype": dtype, "seconds": seconds, "ratio_to_T1": ratio}
    log(f"{name:16s} T=1 {seconds[1] * 1e3:7.1f} ms  ratios " + " ".join(f"{t}:{r:.2f}" for t, r in ratio.items()))
  if cfg.output:
    harness.write_results(results, cfg.output)
  return results


def main(cfg: ml_collections.ConfigDict) -> None:
  unknown = [name for name in cfg.variants if name not in VARIANTS]
  if unknown or (cfg.child and cfg.child not in VARIANTS):
    raise ConfigError(f"config.variants: unknown {unknown or [cfg.child]}; known: {', '.join(VARIANTS)}")
  if cfg.child:  # a subprocess of `run`, measuring one variant
    print(json.dumps(measure(cfg.child, cfg.layers, cfg.repeats, cfg.cache_len, cfg.offset)))
    return
  run(cfg, log=harness.log)


if __name__ == "__main__":
  harness.run_script(main, "Benchmark config (configs/benchmarks/forward_cost.py).")
