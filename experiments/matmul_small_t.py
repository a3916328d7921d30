"""The weight matmul of T = 1..16 token rows on each backend and dtype (`specjax.models.matmul`), timed.

The verify pass multiplies K + 1 activation rows by every weight matrix. Memory-bound, that costs about
one single-token pass; XLA:CPU's GEMM costs ~2x already at T = 2 in float32, and its bfloat16 path is
several times slower still. Weights: `matrices` random 8960 x 1536 matrices (one Qwen-1.5B MLP projection
each, cycled so that they do not sit in cache), median of 7 calls per T. JSON out.

  python -m experiments.matmul_small_t --config=configs/benchmarks/matmul_small_t.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import harness
from specjax import records
from specjax.models import matmul

TOKENS = tuple(range(1, 10)) + (12, 16)
VARIANTS = {
    "xla_float32": ("xla", "float32"), "kernel_float32": ("cpu_kernel", "float32"), "xla_bfloat16": ("xla", "bfloat16"),
    "kernel_bfloat16": ("cpu_kernel", "bfloat16")
}


def run(cfg: ml_collections.ConfigDict, log: harness.Log = print) -> dict:
  """Times every variant at every T; returns the results, also written to `cfg.output` unless empty."""
  rng = np.random.default_rng(0)
  weights = [rng.standard_normal((8960, 1536), dtype=np.float32) for _ in range(cfg.matrices)]
  results = {"command": records.command(), "environment": records.environment(), "seconds": {}}
  for name, (backend, dtype) in VARIANTS.items():
    ws = [jnp.asarray(w, dtype) for w in weights]
    fn = jax.jit(lambda ws, x, backend=backend: [matmul.dense(x, w, backend, jnp.float32) for w in ws])
    results["seconds"][name] = {}
    for T in TOKENS:
      x = jnp.ones((T, 1536), dtype)
      jax.block_until_ready(fn(ws, x))
      times = []
      for _ in range(7):
        start = time.perf_counter()
        jax.block_until_ready(fn(ws, x))
        times.append(time.perf_counter() - start)
      results["seconds"][name][T] = float(np.median(times)) / len(ws)
    row = results["seconds"][name]
    log(f"{name:16s} T=1 {row[1] * 1e3:6.2f} ms per matrix ({ws[0].nbytes / row[1] / 1e9:.1f} GB/s)  ratios " +
        " ".join(f"{t}:{s / row[1]:.2f}" for t, s in row.items()))
  if cfg.output:
    harness.write_results(results, cfg.output)
  return results


def main(cfg: ml_collections.ConfigDict) -> None:
  run(cfg, log=harness.log)


if __name__ == "__main__":
  harness.run_script(main, "Benchmark config (configs/benchmarks/matmul_small_t.py).")
