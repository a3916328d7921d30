"""What a device mesh does to the Qwen2.5-Coder pair: bytes per device and compile time, on simulated CPUs.

  python -m experiments.benchmark_mesh --config=configs/benchmarks/mesh.py \
      --config.output=experiments/results/mesh_cpu.json
  python -m experiments.benchmark_mesh --config=configs/benchmarks/mesh.py \
      --config.report=experiments/results/mesh_cpu.json   # the table of a results file

Each case (mesh, `mesh_indivisible`, `draft_sharding`) runs in a fresh subprocess with `devices`
simulated CPU devices (so memory and compile caches are per case): it loads both models into their
shards (`load_model(..., part)`), reports the bytes the fullest device holds of each model's
parameters and of a `batch_size` x `cache_len` cache of each, compiles the speculative program (greedy,
K = `k`) by calling it with a 1-token budget (`compile_s`: trace + compile + one prefill; `call_s`: the
same call again, compiled), and decodes `run_tokens` tokens for `run_batch` prompts, whose tokens every
case must share with the single-device baseline (`tokens`; compared in the table). Float32 throughout.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import ml_collections

from experiments import harness

PROMPTS = ("def is_palindrome(s):", "Write a function that merges two sorted lists.")


def case(cfg: ml_collections.ConfigDict, mesh_spec: str, indivisible: str, draft_sharding: str) -> dict:
  """One case, in this process (whose device count the parent set)."""
  import dataclasses

  import jax
  import numpy as np

  from specjax import generation, mesh as meshes, partitioning
  from specjax.models.kv_cache import init_cache
  from specjax.models.execution import Execution
  from specjax.models.load import load_model, with_execution
  from specjax.sampling import sampling_params
  from specjax.generation import Request
  from specjax.speculative import speculative_generate
  from specjax.speculative.drafters.model import ModelDrafter
  from specjax.speculative.loop import SpeculativeLoop

  mesh = meshes.make_mesh(mesh_spec)
  target_part = draft_part = None
  if mesh is not None:
    target_part = partitioning.Partitioning(mesh, partitioning.DECODE_RULES, indivisible, "target")
    draft_part = dataclasses.replace(target_part, name="draft")
    draft_part = draft_part.replicated() if draft_sharding == "replicated" else draft_part
  start = time.perf_counter()
  execution = Execution(scan_layers=False, attention="blockwise", attention_block=256, prefill_chunk=512,
                        narrow_passes=True, matmul="xla")
  target = with_execution(load_model(cfg.target, "float32", target_part), execution, target_part)
  draft = with_execution(load_model(cfg.draft, "float32", draft_part), execution, draft_part)
  load_s = time.perf_counter() - start
  result = {
      "mesh": mesh_spec, "mesh_indivisible": indivisible, "draft_sharding": draft_sharding,
      "devices": jax.device_count(), "load_s": load_s
  }
  for role, model in (("target", target), ("draft", draft)):
    per_device = partitioning.bytes_per_device(model.params)
    result[f"{role}_param_bytes"] = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
    result[f"{role}_param_bytes_per_device"] = max(per_device.values())
    result[f"{role}_rules"] = model.part.resolve(model.config) if model.part else {}
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      cache = init_cache(model.config, cfg.batch_size, cfg.cache_len,
                         partitioning.cache_sharding(model.config, model.part))
    result[f"{role}_cache_bytes"] = cache.k.nbytes + cache.v.nbytes
    result[f"{role}_cache_bytes_per_device"] = max(partitioning.bytes_per_device((cache.k, cache.v)).values())
    del cache

  prompts = [target.tokenizer.encode(p) for p in PROMPTS * (cfg.run_batch // len(PROMPTS) + 1)][:cfg.run_batch]
  prompts_BxP, lengths_B = generation.pad_prompts(prompts)
  cache_len = -(-(prompts_BxP.shape[1] + max(cfg.run_tokens, 1) + cfg.k + 1) // 64) * 64
  drafter = ModelDrafter(draft.config, draft.params,
                         cache_sharding=partitioning.cache_sharding(draft.config, draft.part))

  def call(budget: int):
    target_cache = init_cache(target.config, cfg.run_batch, cache_len,
                              partitioning.cache_sharding(target.config, target.part))
    storage = drafter.storage(cfg.run_batch, cache_len)
    rows = (prompts_BxP, lengths_B) if mesh is None else jax.device_put(
        (prompts_BxP, lengths_B), partitioning.rows_sharding(target_part))
    start = time.perf_counter()
    loop = SpeculativeLoop(target.config, cfg.k, out_width=max(cfg.run_tokens, 1))
    request = Request(*rows, budget, target.tokenizer.eos_ids, sampling_params(0.0), jax.random.key(0))
    out = speculative_generate(loop, target.params, drafter, request, target_cache, storage)
    tokens = np.asarray(meshes.to_host(out.tokens)), np.asarray(meshes.to_host(out.counts))
    return time.perf_counter() - start, tokens

  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    result["compile_s"], _ = call(1)
    result["call_s"], _ = call(1)
    if cfg.run_tokens:
      result["run_s"], (tokens, counts) = call(cfg.run_tokens)
      result["tokens"] = generation.as_token_lists(tokens, counts)
  return result


def run(cfg: ml_collections.ConfigDict, log=print) -> dict:
  if not cfg.output:
    raise ValueError("config.output is empty: name the results file (or config.report to print one)")
  results = {"config": cfg.to_dict(), "cases": []}
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={cfg.devices}", "JAX_PLATFORMS": "cpu"}
  for spec in cfg.cases:
    mesh_spec, indivisible, draft_sharding = spec.split("|")
    log(f"case mesh={mesh_spec!r} mesh_indivisible={indivisible} draft_sharding={draft_sharding} ...")
    fields = ("target", "draft", "batch_size", "cache_len", "k", "run_batch", "run_tokens")
    measured, stderr = harness.run_child("experiments.benchmark_mesh", "configs/benchmarks/mesh.py",
                                         {**{field: cfg[field] for field in fields}, "case": spec}, env)
    if measured is None:
      results["cases"].append({
          "mesh": mesh_spec, "mesh_indivisible": indivisible, "draft_sharding": draft_sharding,
          "error": stderr.strip().splitlines()[-1]
      })
    else:
      results["cases"].append(measured)
    harness.write_results(results, cfg.output)
  return results


def table(results: dict) -> str:
  mib = lambda b: f"{b / 2**20:,.0f}"
  cases = results["cases"]
  baseline = next((c for c in cases if not c["mesh"] and "tokens" in c), None)
  lines = [
      "| mesh | indivisible | draft | target params MiB/device (total) | draft params MiB/device (total) | "
      "target cache MiB/device (total) | draft cache MiB/device (total) | compile s | tokens = 1 device |",
      "|---|---|---|---|---|---|---|---|---|"
  ]
  for c in cases:
    if "error" in c:
      lines.append(f"| {c['mesh'] or 'one device'} | {c['mesh_indivisible']} | {c['draft_sharding']} | "
                   f"error: {c['error']} | | | | | |")
      continue
    same = "n/a" if baseline is None or "tokens" not in c else ("yes" if c["tokens"] == baseline["tokens"] else "NO")
    lines.append(f"| {c['mesh'] or 'one device'} | {c['mesh_indivisible']} | {c['draft_sharding']} | "
                 f"{mib(c['target_param_bytes_per_device'])} ({mib(c['target_param_bytes'])}) | "
                 f"{mib(c['draft_param_bytes_per_device'])} ({mib(c['draft_param_bytes'])}) | "
                 f"{mib(c['target_cache_bytes_per_device'])} ({mib(c['target_cache_bytes'])}) | "
                 f"{mib(c['draft_cache_bytes_per_device'])} ({mib(c['draft_cache_bytes'])}) | "
                 f"{c['compile_s'] - c['call_s']:.1f} | {same} |")
  return "\n".join(lines)


def main(cfg: ml_collections.ConfigDict) -> None:
  if cfg.case:  # a subprocess of `run`
    print(json.dumps(case(cfg, *cfg.case.split("|"))))
    return
  harness.report_or_run(cfg, run, table)


if __name__ == "__main__":
  harness.run_script(main, "Benchmark config (configs/benchmarks/mesh.py).")
