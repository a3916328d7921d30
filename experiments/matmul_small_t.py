"""How to contract T = 1..9 token rows with a `[out, in]` weight on XLA CPU: four formulations timed.

The verify pass multiplies K + 1 activation rows by every weight matrix. Memory-bound, that should
cost about one single-token pass; on XLA CPU's GEMM it costs ~2x already at T = 2. Formulations:
  x_Wt       dot_general(x [T, in], W [out, in]) contracting `in` (what the model does)
  W_x        dot_general(W, x) -> [out, T], transposed (W as the large left operand)
  per_token  T separate matrix-vector products (reads W T times)
  reduce     sum over `in` of W[:, None, :] * x[None, :, :] -> [out, T] (a fused reduction that
             could read W once)
Eight 1536 x 8960 matrices (one Qwen-1.5B MLP's worth x ~2.7; `matrices`), float32, median of 7. JSON out.

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

_CONTRACT_IN = (((1,), (1,)), ((), ()))
FORMULATIONS = {
    "x_Wt": lambda W, x: jax.lax.dot_general(x, W, _CONTRACT_IN),
    "W_x": lambda W, x: jax.lax.dot_general(W, x, _CONTRACT_IN).T,
    "per_token": lambda W, x: jnp.concatenate(
        [jax.lax.dot_general(x[t:t + 1], W, _CONTRACT_IN) for t in range(x.shape[0])]),
    "reduce": lambda W, x: jnp.sum(W[:, None, :] * x[None, :, :], axis=-1).T,
}


def run(cfg: ml_collections.ConfigDict, log: harness.Log = print) -> dict:
  """Times every formulation at T = 1..9; returns the results, also written to `cfg.output` unless it is
  empty."""
  rng = np.random.default_rng(0)
  weights = [jnp.asarray(rng.standard_normal((8960, 1536), dtype=np.float32)) for _ in range(cfg.matrices)]
  results = {"command": records.command(), "bytes": sum(w.nbytes for w in weights), "seconds": {}}
  for name, contract in FORMULATIONS.items():
    fn = jax.jit(lambda ws, x, contract=contract: [contract(w, x) for w in ws])
    results["seconds"][name] = {}
    for T in range(1, 10):
      x = jnp.ones((T, 1536), jnp.float32)
      jax.block_until_ready(fn(weights, x))
      times = []
      for _ in range(7):
        start = time.perf_counter()
        jax.block_until_ready(fn(weights, x))
        times.append(time.perf_counter() - start)
      results["seconds"][name][T] = float(np.median(times))
    row = results["seconds"][name]
    log(f"{name:10s} T=1 {row[1] * 1e3:6.1f} ms ({results['bytes'] / row[1] / 1e9:.1f} GB/s)  ratios " +
        " ".join(f"{t}:{s / row[1]:.2f}" for t, s in row.items()))
  if cfg.output:
    harness.write_results(results, cfg.output)
  return results


def main(cfg: ml_collections.ConfigDict) -> None:
  run(cfg, log=harness.log)


if __name__ == "__main__":
  harness.run_script(main, "Benchmark config (configs/benchmarks/matmul_small_t.py).")
