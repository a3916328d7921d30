"""Quantized weights through the CPU matmul kernel against bfloat16 (issue 58): the weight matmuls of the
Qwen2.5-Coder draft (0.5B) and target (1.5B) MLP shapes at a few T, and whole-model passes of a real
model, with bfloat16, int8 and int4:G weights (`specjax.models.quantized`), bfloat16 activations.

Every number is the median of interleaved calls (each variant once per round, in turn: a shared
machine's drift moves them alike). Each matmul variant cycles through copies of its weight whose int4
total exceeds `cfg.stream_bytes` (past the last-level cache, as a model pass streams its weights from
memory; one matrix alone would sit in cache). XLA's own int4 path (dequantize-then-dot, 128 rows at a
time) is timed at T = 1 for reference. One JSON file.

  python -m experiments.quantized_cost --config=configs/benchmarks/quantized_cost.py
"""

from __future__ import annotations

import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import harness
from specjax import costs, records
from specjax.models import matmul, quantized
from specjax.models.load import load_model

SHAPES = {  # a weight [N, K] of the draft's or the target's MLP
    "draft gate/up 4864 x 896": (4864, 896),
    "draft down 896 x 4864": (896, 4864),
    "target gate/up 8960 x 1536": (8960, 1536),
    "target down 1536 x 8960": (1536, 8960),
}
_dense = jax.jit(matmul.dense, static_argnums=(2, 3))


def _matmul_timer(weights: list, x_TxK: jax.Array, backend: str) -> Callable[[], float]:
  """Seconds of one x W^T per call, W the next of `weights` in turn (compiled and run once here)."""
  jax.block_until_ready(_dense(x_TxK, weights[0], backend, None))
  turn = iter(range(10**9))

  def timed() -> float:
    weight = weights[next(turn) % len(weights)]
    start = time.perf_counter()
    _dense(x_TxK, weight, backend, None).block_until_ready()
    return time.perf_counter() - start

  return timed


def matmuls(cfg: ml_collections.ConfigDict, log: harness.Log) -> dict:
  """{shape: {T: {variant: ms}}} for every shape of SHAPES and T of `cfg.tokens`."""
  results = {}
  for shape, (n, k) in SHAPES.items():
    copies = math.ceil(cfg.stream_bytes / (n * k / 2))
    weights = {name: [] for name in cfg.formats}
    for c in range(copies):
      w_NxK = jax.random.normal(jax.random.key(c), (n, k), jnp.float32) * 0.02
      for name in cfg.formats:
        fmt = quantized.parse(name)
        weights[name].append(
            w_NxK.astype(jnp.bfloat16) if fmt is None else quantized.quantize(w_NxK, fmt, jnp.bfloat16))
    results[shape] = {}
    for T in cfg.tokens:
      x_TxK = jnp.asarray(np.random.default_rng(T).standard_normal((T, k)), jnp.bfloat16)
      timers = {f"kernel {name}": _matmul_timer(weights[name], x_TxK, "cpu_kernel") for name in cfg.formats}
      if T == 1 and cfg.xla_reference:
        timers[f"xla {cfg.xla_reference}"] = _matmul_timer(weights[cfg.xla_reference], x_TxK, "xla")
      row = {name: 1e3 * s for name, s in costs.interleaved_medians(timers, cfg.matmul_repeats).items()}
      results[shape][T] = row
      log(f"{shape} T={T} ({copies} copies), ms: " + ", ".join(f"{name} {ms:.3f}" for name, ms in row.items()))
  return results


def passes(cfg: ml_collections.ConfigDict, log: harness.Log) -> dict:
  """{T: {format: ms}}: one forward of [1, T] tokens of `cfg.model` (bfloat16, through the kernel) at
  `cfg.offset` cached positions, per weight format of `cfg.formats`."""
  model = load_model(cfg.model, "bfloat16")
  config = model.config.replace(matmul="cpu_kernel")
  params = {name: quantized.quantize_params(config, model.params, quantized.parse(name)) for name in cfg.formats}
  results = {}
  for T in cfg.tokens:
    timers = {
        name: costs.forward_timer(config, params[name], T, 1, cfg.offset + 16 + T, cfg.offset, None)
        for name in cfg.formats
    }
    results[T] = {name: 1e3 * s for name, s in costs.interleaved_medians(timers, cfg.pass_repeats).items()}
    log(f"{cfg.model} T={T}, ms: " + ", ".join(f"{name} {ms:.1f}" for name, ms in results[T].items()))
  return results


def run(cfg: ml_collections.ConfigDict, log: harness.Log = print) -> dict:
  """The matmuls, then the passes (either skipped when its repeats are 0); returns the results, also
  written to `cfg.output` unless it is empty."""
  results = {
      "command": records.command(), "environment": records.environment(),
      "kernel": matmul.kernel_status("bfloat16", "int4")[1], "formats": list(cfg.formats)
  }
  if cfg.matmul_repeats:
    results["matmul_ms"] = matmuls(cfg, log)
  if cfg.pass_repeats:
    results["pass_ms"] = {"model": cfg.model, "offset": cfg.offset, "ms": passes(cfg, log)}
  if cfg.output:
    harness.write_results(results, cfg.output)
  return results


if __name__ == "__main__":
  harness.run_script(lambda cfg: run(cfg, log=harness.log), "Benchmark config (configs/benchmarks/quantized_cost.py).")
