"""The accelerator run kit: one prepared script for the minutes a GPU or TPU is lent.

  python -m experiments.benchmark_accelerator --config=configs/benchmarks/accelerator.py \
      --config.weights=random --config.output=experiments/results/accelerator_h200.json
  python -m experiments.benchmark_accelerator --config=configs/benchmarks/accelerator.py \
      --config.report=experiments/results/accelerator_h200.json   # the table of a results file

The Qwen2.5-Coder pair (1.5B target, 0.5B draft), autoregressive decoding against speculative decoding
(the draft model proposing K tokens per round) over a grid of prompt lengths x batch sizes x K, greedy,
in the config's dtype. Each cell is one compiled program (`autoregressive.generate` or
`speculative_generate` with a `ModelDrafter`), called four ways:
  1. with a 1-token budget: the compile (plus one prefill), reported as `compile_time_s`;
  2. with the whole budget, once, as a warm-up (`warmup_s`): a 1-token budget never runs the loop's
     body, and its first run was 5-20x slower than later ones on CPU (lazily prepared kernels; CUDA
     loads modules lazily on first launch too);
  3. with a 1-token budget, `repeats` times: `prefill_s` (the median), both models' prefill and the
     first token;
  4. with the whole budget, `repeats` times: `wall_s` (the median), from which decoding alone is
     `wall_s - prefill_s`, over `max_new_tokens - 1` target steps (autoregressive: `step_s`) or the
     loop's rounds (speculative: `round_s`).
First of all (`attention_comparison`), the attention implementations side by side: for each of dense,
blockwise and the kernel (`Execution.resolve` on this backend: the Pallas kernel on GPU), the autoregressive and
K = `comparison_k` cells at the first prompt length and batch 1, each with its program's lowering report
(`lowering.report`: data-dependent while loops inside the round, kernels) and the speculative cell's
greedy comparison; the grid then runs with `attention` ("auto": the kernel on GPU).
Adaptive cells (`adaptive_ks`): the model drafter with the adaptive K policy (`k_policy`), K the most;
between 1. and 2. the policy's cost table is measured with the cell's own program on the device
(`k_policy.calibrate`), and the cell records it with the rounds that chose each length (random weights
accept nothing, so there the policy settles on plain steps: the floor it keeps on the device).
Block cells (`block_drafters`, at the first prompt length, every batch size, K = `block_k`): drafters that
propose the whole block from one draft pass, `parallel` (the draft model fed [lag, pending, MASK x (K - 1)];
its mask is the draft's last id: a PARD fine-tune of the draft has its own, and these timings do not
depend on which) and `dflash` (a DFlash block head of the target's width reading its EAGLE-3 features:
random with weights=random, and also random with weights=real, as no trained head for the pair exists
yet: acceptance is then meaningless, the round time is what such a cell measures). Their rows are like
the speculative cells' (no modelled speedup: the CPU acceptance rates are the draft model's).
Caches are allocated before each timer starts and every timer stops on the tokens reaching the host.
At the first prompt length, each batch size also times target forwards of T = `verify_widths` tokens
(`verify_costs`: seconds and multiples of the 1-token step), the cost of verifying a chain of K = T - 1
or a tree of T - 1 nodes, which the tree cost model of `experiments/report_trees.py` assumes is about
one step on an accelerator up to T = 65.
EOS is ignored, so every row generates exactly `max_new_tokens` tokens in every cell. Before the cells
of a (prompt length, batch size) the draft/target cost ratio c is timed there (`costs.cost_ratio`:
1-token forwards with the prompt cached). Every speculative cell's greedy tokens are compared with the
autoregressive cell's of the same prompts (`greedy_equals_autoregressive`; recorded, never asserted: in
bfloat16 a verify pass of K + 1 tokens may round differently from single steps and flip a near tie).

Two weight sources (`weights`):
  real    the registry models (or any .gguf / HF directory) and prompts cut from the standard library's
          sources to exactly the prompt length: acceptance (alpha_hat) and speedups are measured.
  random  random parameters with the pair's exact shapes (`SHAPES`) and prompts of random token ids: no
          checkpoint or tokenizer needs to travel. Acceptance is meaningless (two unrelated random models
          agree on almost nothing, so every round emits one token), so only timings are measured:
          autoregressive tokens/s, the round time per K and batch size, c; the speedup is *modelled*
          at the acceptance rates of the real pair measured on CPU (`modelled_alphas`), two ways:
            leviathan   (1 - a^(K+1)) / ((1 - a)(K c + 1))  (Leviathan et al.: verify costs one step)
            round_time  E[tokens per round] x step_s / round_s, E = (1 - a^(K+1)) / (1 - a): the
                        measured round, verify pass and loop overhead included. Rounds that accept all
                        K tokens start the next proposal with a 2-token draft pass, which random
                        weights never do: a small underestimate of the round's cost.
With real weights both models are computed at the measured alpha_hat too, next to the measured speedup.

The JSON (`output`) is rewritten after every cell (a killed run keeps what it measured) and holds the
command (from the repository root), the machine and versions, the device kind, the config, the models'
shapes, every cost ratio, one row per cell (memory per device: JAX's `memory_stats`, whose peak covers
the process so far, and the cell's KV-cache bytes) and the skipped cells.

Time on one H200 (bfloat16, default grid; an estimate from the hardware's numbers, not yet a
measurement): 24 programs at an assumed 5-15 s of compilation each (layers under `lax.scan`: flat in
depth) plus 12 pairs of 1-token forward programs for c and 18 target forwards of `verify_costs` (6 widths x
3 batch sizes, 1-2 s each), ~5-6 min; running them ~2 min: at ~4 TB/s the
target's 3.6 GB of weights take ~0.8 ms a step and the draft's 1.3 GB ~0.3 ms, ~2-3 ms each with
per-layer launches, so 128 tokens take ~0.4 s per autoregressive call and, at one token per round
(random weights), ~1-2.5 s per speculative call (K = 3..8), three whole-budget calls per cell; at 2048
tokens and batch 32 the caches (target 28 KiB, draft 12 KiB per token and row in bfloat16) add ~1 ms a
step. About 7-8 minutes in all; `deadline_s` (390 s by default) keeps the total under 8 if compilation is
slower than assumed, skipping the last cells (2048 tokens, batch 32).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable

import jax
import ml_collections
import numpy as np

from experiments import harness
from specjax import autoregressive, corpus, costs, metrics, records
from specjax.speculative.drafters.spelling import check_compatible
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_cache
from specjax import lowering
from specjax.models.execution import FIELDS, Execution
from specjax.models.load import load_model, with_execution
from specjax.models.transformer import init_params
from specjax.generation import Request
from specjax.sampling import sampling_params
from specjax.speculative import k_policy
from specjax.speculative.drafters.base import DraftPass
from specjax.speculative.drafters.dflash import DFlashDrafter
from specjax.speculative.drafters.eagle_head import eagle3_layers, head_config, init_head_params
from specjax.speculative.drafters.model import ModelDrafter, lag_for
from specjax.speculative.drafters.parallel import ParallelDrafter
from specjax.speculative.k_policy import Adaptive, KPolicy, Tables
from specjax.speculative.loop import SpeculativeLoop, speculative_generate

Log = Callable[[str], None]
AUTOREGRESSIVE, SPECULATIVE, ADAPTIVE = "autoregressive", "speculative", "adaptive"  # ADAPTIVE: k_policy
BLOCK_DRAFTERS = ("parallel", "dflash")  # `block_drafters`: one draft pass per round

# (target, draft) shapes for weights=random. "qwen2.5-coder": Qwen2.5-Coder-1.5B-Instruct and
# 0.5B-Instruct exactly as specjax loads them from the registry GGUFs (the "config" metadata of their
# converted caches, $SPECJAX_CACHE/converted/*/params.safetensors; 1.78B and 0.63B parameters; the
# draft's head is untied in these files). tests/test_benchmark_accelerator.py compares them with the
# installed caches.
_QWEN = dict(arch="llama", vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qkv_bias=True, tie_embeddings=False)
_TINY = dict(arch="llama", vocab_size=97, n_heads=4, n_kv_heads=2, head_dim=16, rope_theta=1e4, qkv_bias=True)
SHAPES: dict[str, tuple[ModelConfig, ModelConfig]] = {
    "qwen2.5-coder": (ModelConfig(**_QWEN, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                                  d_ff=8960),
                      ModelConfig(**_QWEN, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, d_ff=4864)),
    "tiny": (
        ModelConfig(**_TINY, d_model=64, n_layers=2, d_ff=128),  # for tests on CPU
        ModelConfig(**_TINY, d_model=64, n_layers=1, d_ff=96)),
}

# The model config fields each results file records.
MODEL_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "dtype",
                "scan_layers")


def check(cfg: ml_collections.ConfigDict) -> None:
  """Fails with a `ConfigError` naming the field before anything loads or compiles."""
  def require(ok: bool, message: str) -> None:
    if not ok:
      raise ConfigError(message)

  require(cfg.weights in ("real", "random"), f"config.weights must be 'real' or 'random', got {cfg.weights!r}")
  require(cfg.weights == "real" or cfg.shapes in SHAPES,
          f"config.shapes must be one of {', '.join(SHAPES)}, got {cfg.shapes!r}")
  require(cfg.dtype in ("float32", "bfloat16"), f"config.dtype must be float32 or bfloat16, got {cfg.dtype!r}")
  try:
    for setting in (cfg.attention, *cfg.attention_comparison):
      execution(cfg, setting)
  except ValueError as error:
    raise ConfigError(f"config.{error} (scan_layers / attention / attention_comparison / narrow_passes)") from None
  require(
      int(cfg.comparison_k) == cfg.comparison_k and cfg.comparison_k >= 1,
      f"config.comparison_k must be an integer >= 1, got {cfg.comparison_k}")
  for field in ("prompt_lengths", "batch_sizes", "ks"):
    values = cfg[field]
    require(
        len(values) > 0 and all(int(v) == v and v >= 1 for v in values),
        f"config.{field} must be a non-empty tuple of integers >= 1, got {values}")
  require(
      set(cfg.block_drafters) <= set(BLOCK_DRAFTERS),
      f"config.block_drafters must be a tuple of {BLOCK_DRAFTERS}, got {cfg.block_drafters}")
  require(
      int(cfg.block_k) == cfg.block_k and cfg.block_k >= 2, f"config.block_k must be an integer >= 2, "
      f"got {cfg.block_k}")
  require(all(int(v) == v and v >= 1 for v in cfg.adaptive_ks),
          f"config.adaptive_ks must be a tuple of integers >= 1, got {cfg.adaptive_ks}")
  for field in ("max_new_tokens", "repeats", "cost_repeats"):
    require(
        int(cfg[field]) == cfg[field] and cfg[field] >= 1, f"config.{field} must be an integer >= 1, "
        f"got {cfg[field]}")
  require(cfg.max_new_tokens >= 2, f"config.max_new_tokens must be >= 2 (one token comes from the prefill), "
          f"got {cfg.max_new_tokens}")
  widths = cfg.verify_widths
  require(not widths or (1 in widths and all(int(w) == w and w >= 1 for w in widths)),
          f"config.verify_widths must be () or integers >= 1 that include 1 (the step), got {widths}")
  for name, alpha in cfg.modelled_alphas.items():
    require(0.0 <= alpha < 1.0, f"config.modelled_alphas.{name} must be in [0, 1), got {alpha}")
  if cfg.mtbench and cfg.weights == "real":
    from experiments import mtbench

    mtbench.plan(mtbench_config(cfg))  # its config's errors, before anything loads


# ---------------------------------------------------------------------------------------------- models


def _random_model(config: ModelConfig, seed: int):
  """Random params of `config` (normal, std 0.02), made in its dtype on the device by one jitted call."""
  return jax.jit(init_params, static_argnums=0)(config, jax.random.key(seed))


def execution(cfg: ml_collections.ConfigDict, attention: str = "") -> Execution:
  """The kit's execution record on this backend (weight matmuls on XLA, the GEMM libraries of GPUs and
  TPUs), with the attention setting `attention` in place of `cfg.attention` if given."""
  settings = {name: cfg[name] for name in FIELDS if name != "matmul"}
  return Execution.resolve({**settings, "attention": attention or cfg.attention, "matmul": "xla"}, cfg.dtype)


def load_pair(cfg: ml_collections.ConfigDict, log: Log):
  """(target config, target params, draft config, draft params, tokenizer or None) of `cfg`."""
  record = execution(cfg)
  start = time.perf_counter()
  if cfg.weights == "real":
    log(f"loading {cfg.target} and {cfg.draft} ({cfg.dtype}) ...")
    target, draft = (with_execution(load_model(name, cfg.dtype), record) for name in (cfg.target, cfg.draft))
    check_compatible(target, draft)
    pair = (target.config, target.params, draft.config, draft.params, target.tokenizer)
  else:
    log(f"random parameters of the {cfg.shapes} pair ({cfg.dtype}) ...")
    target_config, draft_config = (c.replace(dtype=cfg.dtype, **record.fields()) for c in SHAPES[cfg.shapes])
    pair = (target_config, _random_model(target_config,
                                         cfg.seed), draft_config, _random_model(draft_config, cfg.seed + 1), None)
  jax.block_until_ready((pair[1], pair[3]))
  log(f"models ready in {time.perf_counter() - start:.1f} s")
  return pair


def prompt_ids(tokenizer, vocab_size: int, batch_size: int, length: int, seed: int) -> np.ndarray:
  """[batch_size, length] int32 prompts of exactly `length` tokens: random ids (no tokenizer), or the
  first `length` tokens of standard-library sources long enough, one file per row in name order."""
  if tokenizer is None:
    return np.random.default_rng(seed).integers(0, vocab_size, (batch_size, length), dtype=np.int32)
  rows = []
  for doc in corpus.read_documents(corpus.STDLIB):
    ids = tokenizer.encode(doc.text[:16 * length])
    if len(ids) >= length:
      rows.append(ids[:length])
      if len(rows) == batch_size:
        return np.asarray(rows, np.int32)
  raise ValueError(f"the standard library has only {len(rows)} sources of {length} tokens or more")


# ----------------------------------------------------------------------------------------------- cells


def _memory() -> list[dict]:
  """Per local device: JAX's allocator statistics where the backend keeps them (None on CPU)."""
  rows = []
  for device in jax.local_devices():
    stats = device.memory_stats() or {}
    rows.append({
        "device": str(device),
        **{field: stats.get(field) for field in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")}
    })
  return rows


def _cache_bytes(config: ModelConfig, batch_size: int, cache_len: int) -> int:
  """Bytes of one model's K and V cache: 2 x [layers, B, S, G, Dh] in its dtype."""
  return (2 * config.n_layers * batch_size * cache_len * config.n_kv_heads * config.head_dim *
          config.jnp_dtype.itemsize)


def modelled(alpha: float, k: int, c: float, step_s: float, round_s: float) -> dict:
  """The speedup of K-token speculation at acceptance rate `alpha`, modelled two ways (module docstring):
  Leviathan et al.'s formula (verify costing one target step) and the measured round time."""
  return {
      "alpha": alpha, "leviathan": metrics.theoretical_speedup(alpha, k, c),
      "round_time": metrics.expected_accepted_length(alpha, k) * step_s / round_s
  }


def make_drafter(cfg, pair, mode: str, k: int, policy: KPolicy):
  """The drafter of a cell's `mode` (None when autoregressive): the draft model as a chain drafter, as a
  parallel drafter (mask: its last id), or a random DFlash head of the target's shape reading its EAGLE-3
features (every block's of a target under 4 layers) (module docstring)."""
  target_config, target_params, draft_config, draft_params, _ = pair
  if mode == AUTOREGRESSIVE:
    return None
  if mode == "parallel":
    return ParallelDrafter(draft_config, draft_params, draft_config.vocab_size - 1, k)
  if mode == "dflash":
    layers = target_config.n_layers
    config = head_config(target_config, eagle3_layers(layers) if layers >= 4 else tuple(range(layers)))
    params = jax.jit(init_head_params, static_argnums=(0, 2))(config, jax.random.key(cfg.seed + 2), True)
    return DFlashDrafter(config, params, target_config, target_params)
  return ModelDrafter(draft_config, draft_params, max_lag=lag_for(policy.plain_rounds, draft_config))


def run_cell(cfg, pair, mode: str, k: int, prompts_BxP: np.ndarray, cache_len: int, log: Log,
             report: bool = False) -> tuple[dict, np.ndarray]:
  """One program, compiled, warmed up and timed (module docstring); returns its row (with `report`, the
  program's `lowering.report` too) and its greedy tokens [B, max_new_tokens]."""
  target_config, target_params, draft_config, draft_params, _ = pair
  batch, length = prompts_BxP.shape
  lengths_B = np.full((batch,), length, np.int32)
  policy = Adaptive() if mode == ADAPTIVE else KPolicy()
  drafter = make_drafter(cfg, pair, mode, k, policy)
  sampling, key = sampling_params(0.0), jax.random.key(cfg.seed)
  # The policy's cost table and acceptance prior (what the adaptive one learns; a fixed K ignores them).
  memory = k_policy.Memory(policy.prior, k) if drafter else None

  def call(budget: int, round_limit: int | None = None, lower: bool = False):
    target_cache = init_cache(target_config, batch, cache_len)
    storage = drafter.storage(batch, cache_len) if drafter else None
    jax.block_until_ready((target_cache, storage))
    start = time.perf_counter()
    if drafter:
      loop = SpeculativeLoop(target_config, k, out_width=cfg.max_new_tokens, policy=policy)
      request = Request(prompts_BxP, lengths_B, budget, (), sampling, key, round_limit)
      out = speculative_generate(loop, target_params, drafter, request, target_cache, storage,
                                 Tables(memory.cost_C, memory.prior_AxK), lower)
    else:
      request = Request(prompts_BxP, lengths_B, budget, (), sampling, key)
      out = autoregressive.generate(target_config, target_params, request, target_cache, out_width=cfg.max_new_tokens,
                                    lower=lower)
    if lower:
      return out
    tokens_BxO, counts_B = jax.device_get((out.tokens, out.counts))
    if policy.tuned:
      memory.learn(*jax.device_get((out.policy_reached, out.policy_accepted)))
    return time.perf_counter() - start, out, tokens_BxO, counts_B

  compile_s = call(1)[0]
  calibration_s = 0.0
  if policy.tuned:  # the cost table, measured here with this program (`k_policy.calibrate`)

    def forced(cost_C: np.ndarray, round_limit: int) -> int:
      memory.cost_C = cost_C
      return int(call(cfg.max_new_tokens, round_limit)[1].target_calls) - 1

    start = time.perf_counter()
    cost_C = k_policy.calibrate(policy.candidates(k), forced)
    calibration_s, memory.cost_C = time.perf_counter() - start, cost_C
  warmup_s = call(cfg.max_new_tokens)[0]
  prefill_s = float(np.median([call(1)[0] for _ in range(cfg.repeats)]))
  runs = [call(cfg.max_new_tokens) for _ in range(cfg.repeats)]
  wall_s = float(np.median([seconds for seconds, *_ in runs]))
  _, out, tokens_BxO, counts_B = runs[-1]
  decode_s = wall_s - prefill_s
  calls = int(out.target_calls) - 1  # target passes after the prefill: steps, or rounds
  row = {
      "prompt_tokens": length, "batch_size": batch, "mode": mode, "k": k if drafter else None, "cache_len": cache_len,
      "compile_time_s": compile_s, "warmup_s": warmup_s, "prefill_s": prefill_s, "wall_s": wall_s,
      "wall_s_runs": [seconds for seconds, *_ in runs], "generated_tokens": int(counts_B.sum()), "decode_s": decode_s,
      "target_calls_after_prefill": calls,
      "kv_cache_bytes": _cache_bytes(target_config, batch, cache_len) +
                        (_cache_bytes(drafter.cache_config, batch, cache_len) if drafter else 0)
  }
  if drafter:
    totals = metrics.summarize(jax.device_get(out.acceptance))["total"]
    row.update(round_s=decode_s / calls, draft_calls=int(out.draft_calls), alpha_hat=totals["alpha_hat"],
               acceptance_rate=totals["acceptance_rate"], mean_accepted_length=totals["mean_accepted_length"])
  if policy.tuned:
    row["k_policy"] = {
        "lengths": list(policy.lengths(k)), "cost_table_s": [float(c) for c in memory.cost_C],
        "calibration_time_s": calibration_s, "acceptance_learned": [float(a) for a in memory.prior_AxK[0]],
        "rounds_per_length": [int(n) for n in jax.device_get(out.rounds_per_length)]
    }
  else:
    row["step_s"] = decode_s / calls
  row.update(tokens_per_second=row["generated_tokens"] / wall_s,
             decode_tokens_per_second=(row["generated_tokens"] - batch) / decode_s, memory=_memory())
  if report:
    row["lowering"] = lowering.report(call(cfg.max_new_tokens, lower=True))
  log(f"P={length} B={batch} {mode}{f' K={k}' if drafter else ''}: compile {compile_s:.1f} s, prefill "
      f"{prefill_s * 1e3:.1f} ms, " + (f"round {row['round_s'] * 1e3:.2f} ms" if drafter else
                                       f"step {row['step_s'] * 1e3:.2f} ms, {row['tokens_per_second']:.1f} tok/s"))
  return row, tokens_BxO


def derive(cfg, row: dict, baseline: dict, baseline_tokens_BxO: np.ndarray, tokens_BxO: np.ndarray, c: float) -> None:
  """Adds to a speculative row what compares it with its autoregressive baseline: c, the round's cost in
  target steps, the greedy comparison, the modelled speedups and (real weights) the measured ones."""
  equal_B = (tokens_BxO == baseline_tokens_BxO).all(axis=1)
  k, step_s, round_s = row["k"], baseline["step_s"], row["round_s"]
  # The models assume K tokens every round: adaptive cells vary the length and get none.
  fixed = row["mode"] == SPECULATIVE
  row.update(
      cost_ratio_c=c, round_in_target_steps=round_s / step_s, greedy_equals_autoregressive=bool(equal_B.all()),
      rows_equal_autoregressive=int(equal_B.sum()), modelled_speedup={
          name: modelled(alpha, k, c, step_s, round_s) for name, alpha in cfg.modelled_alphas.items() if fixed
      })
  if cfg.weights == "real":
    alpha = row["alpha_hat"]
    row.update(speedup=row["tokens_per_second"] / baseline["tokens_per_second"],
               decode_speedup=row["decode_tokens_per_second"] / baseline["decode_tokens_per_second"])
    if fixed:
      row["modelled_speedup"]["measured_alpha"] = None if alpha is None else modelled(alpha, k, c, step_s, round_s)
  else:  # every round emitted one token: nothing here measures acceptance or a speedup
    for field in ("alpha_hat", "acceptance_rate", "mean_accepted_length", "tokens_per_second",
                  "decode_tokens_per_second"):
      row.pop(field)


def verify_costs(cfg, target_config: ModelConfig, target_params, batch: int, length: int) -> dict:
  """Median seconds of a T-token target forward for each T of `verify_widths`, `length` tokens cached, and
  each as a multiple of the 1-token step: what a chain of T - 1 or a tree of T - 1 nodes costs to verify."""
  cache_len = -(-(length + max(cfg.verify_widths)) // 64) * 64
  seconds = costs.forward_seconds(target_config, target_params, sorted(cfg.verify_widths), cfg.cost_repeats, batch,
                                  cache_len=cache_len, offset=length)
  return {
      "prompt_tokens": length, "batch_size": batch, "seconds": seconds,
      "in_target_steps": {t: s / seconds[1] for t, s in seconds.items()}
  }


# ------------------------------------------------------------------------------------------------- run


def run(cfg: ml_collections.ConfigDict, log: Log = print) -> dict:
  """Runs the grid of `cfg` until done or past `deadline_s`; returns the results, also in `cfg.output`."""
  start = time.perf_counter()
  check(cfg)
  if os.path.isdir(cfg.output) or not os.path.isdir(os.path.dirname(os.path.abspath(cfg.output))):
    raise ValueError(f"config.output {cfg.output}: not a file in an existing directory")
  config = cfg.to_dict()
  config.update({field: records.relative(cfg[field]) for field in ("target", "draft", "output")})
  environment = {**records.environment(), "device_kind": jax.devices()[0].device_kind}
  results = {
      "command": records.command(), "environment": environment, "config": config, "costs": [], "verify_costs": [],
      "attention_comparison": [], "cells": [], "skipped": [], "finished": False
  }
  save = lambda: harness.write_results(results, cfg.output)
  save()
  pair = load_pair(cfg, log)
  target_config, target_params, draft_config, draft_params, tokenizer = pair
  results["models"] = {
      name: {"num_params": config.num_params(), **{field: getattr(config, field) for field in MODEL_FIELDS}}
      for name, config in (("target", target_config), ("draft", draft_config))
  }
  results["prompt_source"] = "random token ids" if tokenizer is None else "standard-library sources"
  cells = [(length, batch, mode, k)
           for length in cfg.prompt_lengths
           for batch in cfg.batch_sizes
           for mode, k in [(AUTOREGRESSIVE,
                            None), *((SPECULATIVE, k) for k in cfg.ks), *((ADAPTIVE, k) for k in cfg.adaptive_ks), *(
                                (name, cfg.block_k) for name in cfg.block_drafters if length == cfg.prompt_lengths[0])]]
  # Every batch size takes the first rows of the same prompts.
  prompts = {
      length: prompt_ids(tokenizer, target_config.vocab_size, max(cfg.batch_sizes), length, cfg.seed)
      for length in cfg.prompt_lengths
  }
  for setting in cfg.attention_comparison:
    compare_attention(cfg, pair, setting, prompts[cfg.prompt_lengths[0]][:1], results, start, log)
    save()
  log(f"{len(cells)} cells, deadline {cfg.deadline_s:.0f} s")
  baseline = None
  for number, (length, batch, mode, k) in enumerate(cells):
    elapsed = time.perf_counter() - start
    if elapsed > cfg.deadline_s:
      results["skipped"] += [{
          "prompt_tokens": p, "batch_size": b, "mode": m, "k": kk,
          "reason": f"deadline_s {cfg.deadline_s:g} passed ({elapsed:.0f} s)"
      } for p, b, m, kk in cells[number:]]
      log(f"deadline passed at {elapsed:.0f} s: {len(cells) - number} cells skipped")
      break
    cache_len = _cache_len(cfg, length)
    if mode == AUTOREGRESSIVE:
      jax.clear_caches()  # the previous (P, B)'s programs are done with
      prompts_BxP = prompts[length][:batch]
      c = costs.cost_ratio(target_config, target_params, DraftPass(draft_config, draft_params), batch, cfg.cost_repeats,
                           cache_len=cache_len, offset=length)
      results["costs"].append({"prompt_tokens": length, "batch_size": batch, "cost_ratio_c": c})
      log(f"P={length} B={batch}: c = {c:.3f}")
      if cfg.verify_widths and length == cfg.prompt_lengths[0]:
        results["verify_costs"].append(verify_costs(cfg, target_config, target_params, batch, length))
        log(f"P={length} B={batch}: T-token verify / step " +
            ", ".join(f"{t}: {v:.2f}" for t, v in results["verify_costs"][-1]["in_target_steps"].items()))
    row, tokens_BxO = run_cell(cfg, pair, mode, k, prompts_BxP, cache_len, log)
    if mode == AUTOREGRESSIVE:
      baseline = (row, tokens_BxO)
    else:
      derive(cfg, row, *baseline, tokens_BxO, c)
    results["cells"].append(row)
    save()
  if cfg.mtbench:
    del pair, target_params, draft_params  # mtbench loads the pair again through the decode pipeline
    results["mtbench"] = run_mtbench(cfg, time.perf_counter() - start, log)
  results["finished"] = not results["skipped"] and "skipped" not in results.get("mtbench", {})
  results["elapsed_s"] = time.perf_counter() - start
  save()
  log(f"wrote {cfg.output} after {results['elapsed_s']:.0f} s")
  return results


def _cache_len(cfg, length: int) -> int:
  """The caches' positions at prompt length `length`: prompt, budget and the largest K's look-ahead,
  rounded up to 64 (one per prompt length: batch sizes and modes share it)."""
  longest = max(cfg.ks + cfg.adaptive_ks + (cfg.comparison_k,) + ((2 * cfg.block_k,) if cfg.block_drafters else ()))
  return -(-(length + cfg.max_new_tokens + longest + 1) // 64) * 64  # a parallel pass writes 2K


def compare_attention(cfg, pair, setting: str, prompts_BxP: np.ndarray, results: dict, start: float, log: Log) -> None:
  """The autoregressive and K = `comparison_k` cells with attention `setting` (resolved on this
  backend), timed and with their lowering reports, appended to `results["attention_comparison"]`; or
  skipped past the deadline."""
  elapsed = time.perf_counter() - start
  modes = [(AUTOREGRESSIVE, None), (SPECULATIVE, cfg.comparison_k)]
  if elapsed > cfg.deadline_s:
    results["skipped"] += [{
        "prompt_tokens": prompts_BxP.shape[1], "batch_size": 1, "mode": mode, "k": k, "attention": setting,
        "reason": f"deadline_s {cfg.deadline_s:g} passed ({elapsed:.0f} s)"
    } for mode, k in modes]
    return
  jax.clear_caches()
  attention = execution(cfg, setting).attention
  target_config, target_params, draft_config, draft_params, tokenizer = pair
  compared = (target_config.replace(attention=attention), target_params, draft_config.replace(attention=attention),
              draft_params, tokenizer)
  (ar_row, ar_tokens), (row, tokens) = (run_cell(cfg, compared, mode, k, prompts_BxP,
                                                 _cache_len(cfg, prompts_BxP.shape[1]), log, report=True)
                                        for mode, k in modes)
  row.update(round_in_target_steps=row["round_s"] / ar_row["step_s"], greedy_equals_autoregressive=bool(
      (tokens == ar_tokens).all()))
  rows = [ar_row, row]
  for row in rows:
    row["attention"] = attention
    log(f"attention {attention} {row['mode']}: {row['lowering']['while_loops_in_round']} data-dependent while "
        f"loops in the round, kernels {row['lowering']['custom_calls']}")
  results["attention_comparison"] += rows


def mtbench_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The MT-Bench cell's `experiments.mtbench` config: configs/benchmarks/mtbench.py:accelerator on the
  kit's pair, dtype and execution, its results next to the kit's (`<output>_mtbench.json`, `.png`)."""
  from configs.benchmarks import mtbench as mtbench_configs

  mt = mtbench_configs.get_config("accelerator")
  stem = os.path.splitext(cfg.output)[0]
  mt.update(target=cfg.target, draft=cfg.draft, dtype=cfg.dtype, output=f"{stem}_mtbench.json",
            figure=f"{stem}_mtbench.png")
  return mt


def run_mtbench(cfg: ml_collections.ConfigDict, elapsed: float, log: Log) -> dict:
  """The MT-Bench cell (`mtbench_config`), when the weights are real and the deadline has not passed:
  its results file, and per group the systems' speedups and τ (or why it was skipped)."""
  from experiments import mtbench

  if cfg.weights != "real":
    return {"skipped": "weights=random: MT-Bench needs the real pair and its tokenizer"}
  if elapsed > cfg.deadline_s:
    return {"skipped": f"deadline_s {cfg.deadline_s:g} passed ({elapsed:.0f} s)"}
  jax.clear_caches()
  results = mtbench.run(mtbench_config(cfg), log)
  summary = {
      key: {
          r["system"]: {
              "speedup_vs_autoregressive": r.get("speedup_vs_autoregressive"), "tau": r["mean_accepted_length"],
              "tokens_per_second": r["tokens_per_second"]
          } for r in results["runs"] if r["group"] == key
      } for key in results["groups"]
  }
  return {"output": records.relative(results["config"]["output"]), "groups": summary}


_fmt = functools.partial(harness.number, missing="")  # an empty cell for what a cell lacks


def table(results: dict) -> str:
  """The cells as markdown, one row each; speedups labelled measured (real weights) or modelled."""
  env, cfg = results["environment"], results["config"]
  alphas = cfg["modelled_alphas"]
  lines = [
      f"Command: `{results['command']}`  ",
      f"Device: {env.get('device_kind')} ({env['backend']}); jax {env['jax']}, flax {env['flax']}; "
      f"weights {cfg['weights']}, {cfg['dtype']}, {cfg['max_new_tokens']} new tokens; prompts: "
      f"{results.get('prompt_source', '')}.", "",
      "| prompt | batch | mode | K | compile s | prefill ms | step / round ms | round / step | c | tokens/s "
      "| decode tokens/s | α̂ | measured speedup | " +
      " | ".join(f"modelled at α {a:g} ({name}): Leviathan / round time" for name, a in alphas.items()) +
      " | greedy = AR | peak GiB |", "|" + "---|" * (15 + len(alphas))
  ]
  for row in results["cells"]:
    peaks = [m["peak_bytes_in_use"] for m in row["memory"] if m["peak_bytes_in_use"] is not None]
    model = row.get("modelled_speedup", {})
    match = row.get("greedy_equals_autoregressive")
    cells = [
        row["prompt_tokens"], row["batch_size"], row["mode"],
        _fmt(row["k"], "d"),
        _fmt(row["compile_time_s"], ".1f"),
        _fmt(row["prefill_s"] * 1e3, ".1f"),
        _fmt(row.get("step_s", row.get("round_s")) * 1e3),
        _fmt(row.get("round_in_target_steps")),
        _fmt(row.get("cost_ratio_c"), ".3f"),
        _fmt(row.get("tokens_per_second"), ".1f"),
        _fmt(row.get("decode_tokens_per_second"), ".1f"),
        _fmt(row.get("alpha_hat"), ".3f"),
        _fmt(row.get("decode_speedup")),
        *(f"{model[name]['leviathan']:.2f} / {model[name]['round_time']:.2f}" if name in model else ""
          for name in alphas),
        "" if match is None else "yes" if match else f"NO ({row['rows_equal_autoregressive']} rows equal)",
        _fmt(max(peaks) / 2**30 if peaks else None)
    ]
    lines.append("| " + " | ".join(str(x) for x in cells) + " |")
  for skipped in results["skipped"]:
    if "attention" in skipped:
      continue  # listed with the attention comparison
    lines.append(f"| {skipped['prompt_tokens']} | {skipped['batch_size']} | {skipped['mode']} | "
                 f"{_fmt(skipped['k'], 'd')} | skipped: {skipped['reason']} |" + " |" * (10 + len(alphas)))
  compared = results.get("attention_comparison", [])
  compared_skipped = [s for s in results["skipped"] if "attention" in s]
  if compared or compared_skipped:
    lines += [
        "", "Attention compared (the first prompt length, batch 1; loops: data-dependent while loops inside "
        "the round, each a host read of its predicate per iteration on GPU):", "",
        "| attention | mode | K | compile s | step / round ms | round / step | greedy = AR | loops in round "
        "| kernels |", "|---|---|---|---|---|---|---|---|---|"
    ]
    for row in compared:
      match = row.get("greedy_equals_autoregressive")
      lines.append(f"| {row['attention']} | {row['mode']} | {_fmt(row['k'], 'd')} "
                   f"| {_fmt(row['compile_time_s'], '.1f')} "
                   f"| {_fmt(row.get('step_s', row.get('round_s')) * 1e3)} | {_fmt(row.get('round_in_target_steps'))} "
                   f"| {'' if match is None else 'yes' if match else 'NO'} "
                   f"| {row['lowering']['while_loops_in_round']} | "
                   f"{', '.join(f'{name} x{n}' for name, n in row['lowering']['custom_calls'].items())} |")
    lines += [
        f"| {s['attention']} | {s['mode']} | {_fmt(s['k'], 'd')} | skipped: {s['reason']} | | | | | |"
        for s in compared_skipped
    ]
  mt = results.get("mtbench")
  if mt:
    lines += [
        "", f"MT-Bench cell: skipped ({mt['skipped']})."
        if "skipped" in mt else f"MT-Bench cell (`{mt['output']}`; its tables: `python -m experiments.mtbench "
        f"--config=configs/benchmarks/mtbench.py:accelerator --config.report={mt['output']}`): " +
        "; ".join(f"{key}: " + ", ".join(f"{system} {_fmt(v['speedup_vs_autoregressive'])}x (τ {_fmt(v['tau'])})"
                                         for system, v in systems.items()
                                         if system != "autoregressive")
                  for key, systems in mt["groups"].items()) + "."
    ]
  lines += [
      "", "Measured speedup: decode tokens/s over the autoregressive cell's (real weights only). Modelled: "
      "Leviathan et al. at the measured c; round time = expected tokens per round x step / round. "
      "Peak memory: JAX's peak since the process started."
  ]
  for row in results["cells"]:
    if "k_policy" in row:
      policy = row["k_policy"]
      lines.append(f"Adaptive, prompt {row['prompt_tokens']}, batch {row['batch_size']}, K <= {row['k']}: rounds per "
                   "length " + ", ".join(f"{n}: {r}" for n, r in zip(policy["lengths"], policy["rounds_per_length"])) +
                   "; round cost measured on the device " +
                   ", ".join(f"{n}: {1e3 * c:.2f} ms" for n, c in zip(policy["lengths"], policy["cost_table_s"])) + ".")
  verify = results.get("verify_costs", [])
  if verify:
    widths = list(verify[0]["in_target_steps"])
    lines += [
        "", "Target forward of T tokens / 1-token step (the verify of T - 1 draft tokens or tree nodes):", "",
        "| prompt | batch | " + " | ".join(f"T = {t}" for t in widths) + " |", "|" + "---|" * (2 + len(widths))
    ]
    lines += [
        f"| {v['prompt_tokens']} | {v['batch_size']} | " + " | ".join(f"{v['in_target_steps'][t]:.2f}"
                                                                      for t in widths) + " |"
        for v in verify
    ]
  return "\n".join(lines)


def main(cfg: ml_collections.ConfigDict) -> None:
  harness.report_or_run(cfg, run, table)


if __name__ == "__main__":
  harness.run_script(main, "Kit config (configs/benchmarks/accelerator.py).")
