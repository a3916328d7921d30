"""Suffix decoding on the workloads where text from earlier requests recurs: one command, one JSON.

  python -m experiments.benchmark_suffix --config=configs/benchmarks/suffix.py

Each workload runs through one `specjax.Decoder`. Its requests go in order, so a pool drafter's pool
holds every earlier request of the workload. Every pool is emptied (`Decoder.reset_pool`) before each
workload and system.
  repeated_task     one instruction (type hints and a docstring) applied to the functions of one stdlib
                    module, batch 1, greedy; tokens/s counted from request `from_request` on
  mtbench_turn2     MT-Bench conversations (the first of each of `mtbench_categories`), both turns, batch 1,
                    greedy; turn 2 reported
  code_edit         configs/code_edit_prompts.py edits, batch 1, greedy
  self_consistency  `samples` copies of one prompt in one batch at `temperature`
Systems (`systems`): specjax autoregressive first, again after every `ar_every` systems and last;
speedups divide by the mean of the baseline runs. The systems are:
  - n-gram lookup;
  - suffix without a pool: the row's own history only (`pool_tokens` 0, `across_rows` off);
  - suffix with its pool and batch;
  - suffix with the adaptive K policy.
Each system records:
  - tokens/s;
  - τ (mean accepted length) and α̂;
  - the pool hit rate: rounds that proposed at least one token, out of all rounds;
  - the mean speculation length per round;
  - per-position acceptance.
With `transformers` set, the greedy batch-1 workloads also run transformers' prompt lookup (the peer)
and plain generate on the same input ids.

The JSON (`output`) is rewritten after every run, so a killed run keeps what it measured.
"""

from __future__ import annotations

import gc
import inspect
import textwrap
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from configs import code_edit_prompts
from experiments import harness, hf_reference
from experiments.harness import number
from specjax import prompts as prompt_sets, records
from specjax.api import Decoder
from specjax.errors import ConfigError

WORKLOADS = ("repeated_task", "mtbench_turn2", "code_edit", "self_consistency")
AUTOREGRESSIVE = "autoregressive"
REPEATED_INSTRUCTION = ("Add type hints and a one-paragraph docstring to this function. Return the complete "
                        "function in one Python code block.\n\n```python\n{source}```")


def repeated_task_prompts(module: str, count: int) -> list[str]:
  """The instruction applied to the first `count` top-level functions of the stdlib module `module`
  (in source order; functions of 6 to 40 lines)."""
  import importlib

  mod = importlib.import_module(module)
  functions = [f for _, f in inspect.getmembers(mod, inspect.isfunction) if f.__module__ == mod.__name__]
  functions.sort(key=lambda f: f.__code__.co_firstlineno)
  sources = [textwrap.dedent(inspect.getsource(f)) for f in functions]
  sources = [s for s in sources if 6 <= len(s.splitlines()) <= 40]
  if len(sources) < count:
    raise ConfigError(f"config.repeated_task.module {module!r} has {len(sources)} functions of 6-40 lines, "
                      f"fewer than config.repeated_task.requests = {count}")
  return [REPEATED_INSTRUCTION.format(source=s) for s in sources[:count]]


def system_fields(cfg: ml_collections.ConfigDict, system: str) -> dict[str, Any]:
  """The decode fields of one system of `cfg.systems`."""
  if system == AUTOREGRESSIVE:
    return {"mode": AUTOREGRESSIVE}
  speculative = {"mode": "speculative", "k": cfg.k, "k_policy": "fixed"}
  suffix = cfg.suffix.to_dict()
  known = {
      "ngram": {"drafter": "ngram", "ngram": cfg.ngram.to_dict()},
      "suffix_no_pool": {"drafter": "suffix", "suffix": {**suffix, "pool_tokens": 0, "across_rows": False}},
      "suffix_pool": {"drafter": "suffix", "suffix": suffix},
      "suffix_pool_adaptive": {"drafter": "suffix", "suffix": suffix, "k_policy": "adaptive"},
  }
  if system not in known:
    raise ConfigError(f"config.systems: unknown system {system!r}; known: {AUTOREGRESSIVE}, {', '.join(known)}")
  return {**speculative, **known[system]}


def workload_call(cfg: ml_collections.ConfigDict, workload: str) -> tuple[dict[str, Any], list[int] | None]:
  """The `Decoder.run` fields of a workload and which outputs its tokens/s counts (None: a turn's own
  statistics, or all outputs)."""
  if workload == "repeated_task":
    texts = repeated_task_prompts(cfg.repeated_task.module, cfg.repeated_task.requests)
    return {"prompts": tuple(texts), "chat": cfg.chat, "batch_size": 1, "temperature": 0.0}, \
        list(range(cfg.repeated_task.from_request - 1, len(texts)))
  if workload == "mtbench_turn2":
    return {
        "prompts": (), "prompts_file": prompt_sets.MT_BENCH + f"?category={cfg.mtbench_categories}&per_category=1",
        "chat": cfg.chat, "batch_size": 1, "temperature": 0.0
    }, None
  if workload == "code_edit":
    return {
        "prompts": tuple(code_edit_prompts.code_edit_prompts()[:cfg.code_edit_requests]), "chat": cfg.chat,
        "batch_size": 1, "temperature": 0.0
    }, None
  if workload == "self_consistency":
    return {
        "prompts": (cfg.self_consistency.prompt,) * cfg.self_consistency.samples, "chat": cfg.chat,
        "batch_size": cfg.self_consistency.samples, "temperature": cfg.self_consistency.temperature
    }, None
  raise ConfigError(f"config.workloads: unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


def measured(result: dict, counted: list[int] | None, workload: str) -> dict[str, Any]:
  """What one run reports: tokens/s and acceptance over the counted outputs (or turn 2)."""
  stats = result["stats"]
  if workload == "mtbench_turn2":
    stats = stats["turns"][1]
  outputs = result["outputs"]
  if counted is not None:
    chosen = [outputs[i] for i in counted]
    tokens, wall = sum(o["num_tokens"] for o in chosen), sum(o["batch_wall_time_s"] for o in chosen)
    row = {
        "tokens_per_second": tokens / wall, "generated_tokens": tokens, "wall_time_s": wall,
        "counted_requests": [i + 1 for i in counted]
    }
    per_row = [o.get("stats") for o in chosen]
    if per_row[0] is not None:
      total = {key: sum(s[key] for s in per_row) for key in ("rounds", "proposed", "accepted", "rejections")}
      reached = np.sum([s["reached_at_position"] for s in per_row], axis=0)
      accepted_at = np.sum([s["accepted_at_position"] for s in per_row], axis=0)
      row.update(
          _acceptance(total["rounds"], total["proposed"], total["accepted"], total["rejections"], reached, accepted_at))
    return row
  row = {key: stats.get(key) for key in ("tokens_per_second", "generated_tokens", "wall_time_s")}
  acceptance = stats.get("acceptance")
  if acceptance:
    row.update(
        _acceptance(acceptance["rounds"], acceptance["proposed"], acceptance["accepted"], acceptance["rejections"],
                    np.asarray(acceptance["reached_at_position"]), np.asarray(acceptance["accepted_at_position"])))
  return row


def _acceptance(rounds, proposed, accepted, rejections, reached_K, accepted_K) -> dict[str, Any]:
  """τ, α̂, the hit rate (rounds proposing >= 1 token: position 1 is reached whenever it is proposed) and
  the mean speculation length per round."""
  ratio = lambda a, b: float(a) / float(b) if b else None
  return {
      "rounds": int(rounds), "tau": ratio(accepted + rounds,
                                          rounds), "alpha_hat": ratio(accepted, accepted + rejections),
      "hit_rate": ratio(reached_K[0], rounds), "mean_proposed_per_round": ratio(proposed, rounds),
      "per_position_acceptance": [ratio(a, r) for a, r in zip(accepted_K, reached_K)]
  }


def run(cfg: ml_collections.ConfigDict, log: harness.Log = print) -> dict:
  """Every workload of `cfg`, every system, with the baseline alternating; returns the results (also
  written to `cfg.output` after every run)."""
  calls = {w: workload_call(cfg, w) for w in cfg.workloads}
  for system in cfg.systems:
    system_fields(cfg, system)  # an unknown system fails before the model loads
  results = {
      "command": records.command(), "environment": records.environment(), "config": cfg.to_dict(), "runs": [],
      "transformers": []
  }
  save = lambda: cfg.output and harness.write_results(results, cfg.output)
  start = time.perf_counter()
  dec = Decoder(target=cfg.target, drafter="ngram", dtype=cfg.dtype, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                log=log)  # every system is model-free: no draft model loads
  results["load_time_s"] = time.perf_counter() - start
  for workload in cfg.workloads:
    fields, counted = calls[workload]
    # Each compiled program of the 1.5B target holds ~1 GB of code and buffers: drop the last workload's
    # (a run that kept them all died compiling its ~30th, LLVM out of memory).
    jax.clear_caches()
    order = [AUTOREGRESSIVE]
    for count, system in enumerate(cfg.systems, 1):
      order += [system] + ([AUTOREGRESSIVE] if count % cfg.ar_every == 0 or count == len(cfg.systems) else [])
    for system in order:
      dec.reset_pool()
      result = dec.run(**fields, **system_fields(cfg, system))
      row = {
          "workload": workload, "system": system, "batch_size": fields["batch_size"],
          "temperature": fields["temperature"],
          **measured(result, counted, workload), "compile_time_s": result["stats"]["compile_time_s"],
          "rounds_per_length": result["stats"].get("k_policy", {}).get("rounds_per_length"),
          "token_ids": [o["token_ids"] for o in result["outputs"]]
      }
      results["runs"].append(row)
      derive(results)
      save()
      log(f"{workload} {system}: {row['tokens_per_second']:.2f} tok/s, speedup "
          f"{number(row.get('speedup_vs_autoregressive'))}, tau {number(row.get('tau'))}, hit rate "
          f"{number(row.get('hit_rate'))}, greedy = AR {row.get('outputs_match_autoregressive')}")
  if cfg.pool_sizes:
    results["drafter_cost"] = drafter_cost(cfg, dec, results, log)
    save()
  if cfg.transformers:
    tokenizer = dec.target.tokenizer
    del dec
    gc.collect()
    run_transformers(cfg, calls, tokenizer, results, save, log)
  derive(results)
  save()
  return results


def drafter_cost(cfg: ml_collections.ConfigDict, dec: Decoder, results: dict, log: harness.Log) -> dict:
  """The suffix drafter's own cost per round (its jitted `propose`, median of `cost_repeats`) with pools of
  `pool_sizes` tokens (standard-library sources, tokenized), at batch 1 and 8 with histories of
  `cost_history` tokens, against the suffix_pool runs' mean round time (wall time / rounds) at that batch;
  and the time to index a pool of that size (paid once per call, when the call's sequences are added)."""
  from specjax.sampling import sampling_params
  from specjax.speculative.drafters.suffix import SuffixDrafter, warm_pool
  from specjax.speculative.drafters.suffix_pool import Pool, empty_pool
  from specjax.speculative.plan import RoundPlan

  vocab = dec.target.config.vocab_size
  largest, _ = warm_pool(empty_pool(max(cfg.pool_sizes)), "stdlib", dec.target.tokenizer.encode, max(cfg.pool_sizes))
  rounds = {}
  for row in results["runs"]:
    if row["system"] == "suffix_pool" and row.get("rounds"):
      rounds.setdefault(row["batch_size"], []).append(row["wall_time_s"] / row["rounds"] * row["batch_size"])
  propose = jax.jit(SuffixDrafter.propose)
  out = []
  for batch in (1, 8):
    rng = np.random.default_rng(0)
    history = jax.numpy.asarray(rng.integers(0, vocab, (batch, cfg.cost_history + 64)), jax.numpy.int32)
    for size in cfg.pool_sizes:
      pool = jax.block_until_ready(Pool.of(largest[-size:], int(cfg.suffix.max_match)))  # compiled for the size
      begin = time.perf_counter()
      jax.block_until_ready(Pool.of(largest[-size:], int(cfg.suffix.max_match)))
      index_s = time.perf_counter() - begin  # what each call's `remember` pays once
      drafter = SuffixDrafter(vocab_size=vocab, pool=pool, **SuffixDrafter.search_fields(cfg.suffix))
      state = drafter.init(drafter.storage(batch, history.shape[1]), history,
                           jax.numpy.full((batch,), cfg.cost_history, jax.numpy.int32), None)
      args = (drafter, state, None, history[:, 0], sampling_params(0.0), jax.random.key(0), RoundPlan(cfg.k))
      jax.block_until_ready(propose(*args)[0].tokens)
      seconds = []
      for _ in range(cfg.cost_repeats):
        begin = time.perf_counter()
        jax.block_until_ready(propose(*args)[0].tokens)
        seconds.append(time.perf_counter() - begin)
      round_s = float(np.mean(rounds[batch])) if rounds.get(batch) else None
      out.append({
          "batch_size": batch, "pool_tokens": size, "history_tokens": cfg.cost_history,
          "propose_s": float(np.median(seconds)), "index_s": index_s, "round_s": round_s,
          "share_of_round": float(np.median(seconds)) / round_s if round_s else None
      })
      log(f"suffix propose, batch {batch}, pool {size}: {np.median(seconds) * 1e3:.2f} ms, index {index_s:.2f} s" +
          (f" ({out[-1]['share_of_round']:.1%} of a round)" if round_s else ""))
  return out


def run_transformers(cfg, calls, tokenizer, results, save, log) -> None:
  """transformers' plain generate and prompt lookup (K = cfg.k, n <= cfg.ngram.max) on the greedy batch-1
  workloads' input ids (chat template applied as specjax does), each request timed, after a warm-up."""
  model = hf_reference.hf_model(cfg.target, cfg.dtype)
  lookup = {"prompt_lookup_num_tokens": int(cfg.k), "max_matching_ngram_size": int(cfg.ngram.max)}
  for workload, (fields, counted) in calls.items():
    if fields["batch_size"] != 1 or fields["temperature"] or not fields["prompts"]:
      continue
    ids = prompt_sets.encode(tokenizer, fields["prompts"], fields["chat"])
    counted = counted if counted is not None else list(range(len(ids)))
    for system, kwargs in (("transformers_generate", {}), ("transformers_prompt_lookup", lookup)):
      hf_reference.generate(model, [ids[0]], tokenizer.eos_ids, 2, **kwargs)  # warm-up
      outputs = [
          hf_reference.generate(model, [ids[i]], tokenizer.eos_ids, cfg.max_new_tokens, **kwargs) for i in counted
      ]
      tokens, seconds = sum(len(rows[0]) for rows, _ in outputs), sum(s for _, s in outputs)
      results["transformers"].append({
          "workload": workload, "system": system, "generated_tokens": tokens, "wall_time_s": seconds,
          "tokens_per_second": tokens / seconds, "token_ids": [rows[0] for rows, _ in outputs]
      })
      derive(results)
      save()
      log(f"{workload} {system}: {tokens / seconds:.2f} tok/s")


def derive(results: dict) -> None:
  """Each run's speedup over its workload's mean autoregressive tokens/s, and whether greedy outputs
  equal the first autoregressive run's."""
  for row in results["runs"] + results["transformers"]:
    baseline = [r for r in results["runs"] if r["workload"] == row["workload"] and r["system"] == AUTOREGRESSIVE]
    if not baseline:
      continue
    mean = float(np.mean([r["tokens_per_second"] for r in baseline]))
    row["speedup_vs_autoregressive"] = row["tokens_per_second"] / mean
    reference = baseline[0]["token_ids"]
    if row in results["transformers"]:  # the counted requests only
      reference = reference[-len(row["token_ids"]):]
    row["outputs_match_autoregressive"] = (row["token_ids"] == reference) if not row.get("temperature") else None


def tables(results: dict) -> str:
  """The results as one markdown table per workload."""
  derive(results)
  lines = harness.provenance(results)
  header = "| system | tokens/s | speedup vs AR | τ | α̂ | hit rate | speculated / round | greedy = AR |"
  for workload in results["config"]["workloads"]:
    rows = [r for r in results["runs"] + results["transformers"] if r["workload"] == workload]
    lines += ["", f"#### {workload}", "", header, "|" + "---|" * 8]
    for r in rows:
      lines.append(f"| {r['system']} | {r['tokens_per_second']:.2f} | {number(r.get('speedup_vs_autoregressive'))} "
                   f"| {number(r.get('tau'))} | {number(r.get('alpha_hat'))} | {number(r.get('hit_rate'))} "
                   f"| {number(r.get('mean_proposed_per_round'))} | {r.get('outputs_match_autoregressive')} |")
  return "\n".join(lines)


def main(cfg: ml_collections.ConfigDict) -> None:
  harness.report_or_run(cfg, run, tables)


if __name__ == "__main__":
  harness.run_script(main, "Benchmark config (configs/benchmarks/suffix.py).")
