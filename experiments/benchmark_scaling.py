"""What long caches, long prompts and deep models cost: the numbers behind the accelerator-readiness work.

Three parts, each measured in fresh subprocesses (so peak memory and compile caches are per case) and
written into one JSON file:

  decode   one decode step of the Qwen2.5-Coder-1.5B target (real weights when installed, else random
           ones of its shape; float32) with 512 live tokens per row, in caches of S_max = 1k and 32k
           positions: live-length attention (`attention_block` 256) vs the dense reference (0). Timers
           alternate, and each ratio is the median of back-to-back pairs (the machine drifts).
  loop     autoregressive decoding of the same target inside its compiled `while_loop` (the program
           `python -m specjax.decode` runs): seconds per step at S_max = 1k and 4k, batch 1 and 4, 300-token
           prompts: the cost of anything the loop adds to a step, such as a copy of the whole cache.
  prefill  peak resident memory and time of prefilling one long prompt into a tiny-width model
           (d_model 64, 2 layers), chunked (`prefill_chunk` 512, live-length attention) vs one shot with
           dense attention (the former behaviour), for prompts of 2k-16k tokens.
  compile  compile time of the speculative program (tiny width: d_model 64) for targets of 8, 32 and
           80 layers with a 16-layer draft model, per-layer loop vs `scan_layers`.

  python -m experiments.benchmark_scaling --config=configs/benchmarks/scaling.py
  python -m experiments.benchmark_scaling --config=configs/benchmarks/scaling.py --config.parts='("loop",)' \
      --config.output=""   # one part, printed only
"""

from __future__ import annotations

import json
import time

import ml_collections

from experiments import harness
from specjax import records

CONFIG_FILE = "configs/benchmarks/scaling.py"  # the config of the subprocesses (they read only `child`)
QWEN_1_5B = dict(arch="llama", vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                 d_ff=8960, qkv_bias=True, rope_theta=1e6, tie_embeddings=True)
TINY = dict(arch="llama", vocab_size=512, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)


def _random_params(config):
  import jax

  from specjax.models.transformer import init_params
  return jax.jit(lambda: init_params(config, jax.random.key(0)))()


def decode(repeats: int) -> dict:
  """Per-step seconds at 512 live tokens for each (S_max, attention_block), alternating timers."""
  import numpy as np

  from specjax import costs

  config, params, weights = _qwen_target()
  cases = {f"S{s}_block{b}": (s, b) for s in (1024, 32768) for b in (256, 0)}
  timers = {
      case: costs.forward_timer(config.replace(attention_block=b), params, 1, 1, s, 512, None)
      for case, (s, b) in cases.items()
  }
  samples = {case: [] for case in cases}
  for _ in range(repeats):
    for case, timed in timers.items():
      samples[case].append(timed())
  base = samples["S1024_block256"]
  return {
      "weights": weights, "live_tokens": 512, "repeats": repeats,
      "seconds": {case: float(np.median(s)) for case, s in samples.items()},
      "ratio_to_S1024_block256": {case: float(np.median(np.array(s) / np.array(base))) for case, s in samples.items()}
  }


def _qwen_target():
  """The real Qwen 1.5B target when installed, else random weights of its shape: (config, params, "real" or
  "random")."""
  from specjax.models import registry
  from specjax.models.config import ModelConfig
  from specjax.models.load import load_model

  name = "qwen2.5-coder-1.5b-instruct"
  if registry.is_installed(registry.MODELS[name]):
    loaded = load_model(name)
    return loaded.config, loaded.params, "real"
  config = ModelConfig(**QWEN_1_5B)
  return config, _random_params(config), "random"


def decode_loop(s_max: int, batch: int, repeats: int) -> dict:
  """Seconds per step of autoregressive decoding inside the compiled loop: the best of `repeats` timings
  of 8 and of 72 new tokens after a 300-token prompt per row, their difference over 64 steps."""
  import jax
  import jax.numpy as jnp

  from specjax import autoregressive
  from specjax.generation import Request
  from specjax.models.kv_cache import init_cache
  from specjax.sampling import sampling_params

  config, params, weights = _qwen_target()
  prompts_BxP = jnp.full((batch, 300), 100, jnp.int32)
  lengths_B = jnp.full((batch,), 300, jnp.int32)
  cache = init_cache(config, batch, s_max)
  seconds = {8: [], 72: []}
  for new_tokens in (8,) + (8, 72) * repeats:  # the first call compiles
    start = time.perf_counter()
    request = Request(prompts_BxP, lengths_B, new_tokens, [-1], sampling_params(0.0), jax.random.key(0))
    out = autoregressive.generate(config, params, request, cache, out_width=72)
    out.tokens.block_until_ready()
    cache = out.cache
    seconds[new_tokens].append(time.perf_counter() - start)
  return {
      "weights": weights, "s_max": s_max, "batch": batch, "prompt_tokens": 300, "repeats": repeats,
      "seconds_per_step": (min(seconds[72]) - min(seconds[8][1:])) / 64
  }


def prefill(prompt_len: int, chunk: int, block: int) -> dict:
  """Seconds and peak RSS of one jitted prefill of a `prompt_len`-token prompt (after a warm-up call)."""
  import resource

  import jax
  import jax.numpy as jnp

  from specjax.models.config import ModelConfig
  from specjax.models.kv_cache import init_cache
  from specjax.models.transformer import prefill as run_prefill

  config = ModelConfig(**TINY, n_layers=2, prefill_chunk=chunk, attention_block=block)
  params = _random_params(config)
  baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  step = jax.jit(run_prefill, static_argnums=0, donate_argnums=4)
  prompt_1xP = jnp.ones((1, prompt_len), jnp.int32) % config.vocab_size
  lengths = jnp.array([prompt_len], jnp.int32)
  start = time.perf_counter()
  logits, cache = step(config, params, prompt_1xP, lengths, init_cache(config, 1, prompt_len + 64))
  logits.block_until_ready()
  first = time.perf_counter() - start
  start = time.perf_counter()
  logits, cache = step(config, params, prompt_1xP, lengths, cache)
  logits.block_until_ready()
  return {
      "prompt_tokens": prompt_len, "prefill_chunk": chunk, "attention_block": block,
      "seconds": time.perf_counter() - start, "first_call_seconds": first,
      "cache_bytes": int(cache.k.nbytes + cache.v.nbytes),
      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
      "rss_before_first_call_mib": baseline_kib / 1024
  }


def compile_time(target_layers: int, draft_layers: int, scan: bool) -> dict:
  """Seconds to trace and compile the speculative program (greedy, K = 5, batch 2, cache 128)."""
  import jax
  import numpy as np

  from specjax.generation import Request, pad_prompts
  from specjax.models.config import ModelConfig
  from specjax.models.kv_cache import init_cache
  from specjax.sampling import sampling_params
  from specjax.speculative import speculative_generate
  from specjax.speculative.drafters.model import ModelDrafter
  from specjax.speculative.k_policy import Tables
  from specjax.speculative.loop import SpeculativeLoop

  target = ModelConfig(**TINY, n_layers=target_layers, scan_layers=scan)
  draft = ModelConfig(**TINY, n_layers=draft_layers, scan_layers=scan)
  drafter = ModelDrafter(draft, _random_params(draft))
  padded, lengths = pad_prompts([[1, 2, 3], [4, 5]])
  request = Request(padded, lengths, np.array([16, 16], np.int32), np.array([-1], np.int32), sampling_params(0.0),
                    jax.random.key(0))
  start = time.perf_counter()
  lowered = speculative_generate(SpeculativeLoop(target, 5, out_width=16), _random_params(target), drafter, request,
                                 init_cache(target, 2, 128), drafter.storage(2, 128), Tables(), lower=True)
  traced = time.perf_counter() - start
  compiled = lowered.compile()
  total = time.perf_counter() - start
  return {
      "target_layers": target_layers, "draft_layers": draft_layers, "scan_layers": scan, "trace_seconds": traced,
      "compile_seconds": total, "hlo_bytes": len(compiled.as_text() or "")
  }


def _child(call: str) -> dict:
  """`call` ("function(arg, ...)") evaluated in a fresh process: its result, or its error."""
  result, stderr = harness.run_child("experiments.benchmark_scaling", CONFIG_FILE, {"child": call})
  return {"call": call, "error": stderr[-1500:]} if result is None else result


def run(cfg: ml_collections.ConfigDict, log: harness.Log = print) -> dict:
  """Runs the parts of `cfg`; returns the results, also written to `cfg.output` unless it is empty."""
  results = {"command": records.command()}
  if "decode" in cfg.parts:
    results["decode"] = _child(f"decode({cfg.repeats})")
    log("decode " + json.dumps(results["decode"], indent=1))
  if "loop" in cfg.parts:
    results["loop"] = []
    for s_max, batch in [(1024, 1), (4096, 1), (1024, 4)]:
      results["loop"].append(_child(f"decode_loop({s_max}, {batch}, {cfg.loop_repeats})"))
      log(f"loop {results['loop'][-1]}")
  if "prefill" in cfg.parts:
    results["prefill"] = []
    for prompt_len, chunk, block in [(2048, 512, 256), (4096, 512, 256), (8192, 512, 256), (16384, 512, 256),
                                     (2048, 2048, 0), (4096, 4096, 0), (8192, 8192, 0)]:
      results["prefill"].append(_child(f"prefill({prompt_len}, {chunk}, {block})"))
      log(f"prefill {results['prefill'][-1]}")
  if "compile" in cfg.parts:
    results["compile"] = []
    for layers in (8, 32, 80):
      for scan in (True, False):
        results["compile"].append(_child(f"compile_time({layers}, 16, {scan})"))
        log(f"compile {results['compile'][-1]}")
  if cfg.output:
    harness.write_results(results, cfg.output)
  return results


def main(cfg: ml_collections.ConfigDict) -> None:
  if cfg.child:  # "function(arg, ...)", evaluated in this fresh process (a subprocess of `run`)
    functions = {"decode": decode, "decode_loop": decode_loop, "prefill": prefill, "compile_time": compile_time}
    print(json.dumps(eval(cfg.child, functions)))
    return
  run(cfg, log=harness.log)


if __name__ == "__main__":
  harness.run_script(main, "Benchmark config (configs/benchmarks/scaling.py).")
