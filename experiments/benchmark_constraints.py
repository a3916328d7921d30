"""Constrained decoding benchmark: JSON-extraction and tool-call requests with their JSON schemas, decoded
by specjax autoregressive decoding and each speculative system, without and with the schemas, greedy,
batch 1, on the models loaded once.

  python -m experiments.benchmark_constraints --config=configs/benchmarks/constraints.py [--config.FIELD=...]

Per run: valid-output rate (the output, EOS removed, parses as JSON and validates against the request's
schema with `jsonschema`; a row cut by the budget is invalid), finished rate, tokens/s (prefill included,
compile excluded), alpha_hat and tau (mean accepted length) for speculative systems, and the forced share:
the generated tokens at which the schema allowed exactly one token, counted on the host from the outputs
and, for speculative systems, by the loop itself (`jump_forward_share`: the tokens jump-forward commits
with certainty; lookups propose them for free). A constrained speculative run's greedy tokens are
compared with constrained autoregressive decoding's. Tree systems (`TREES`) draft under the constraint
node by node.

The mask's own cost: the verify pass's masking (`Constrained.along`, then `mask`) of [B, K + 1, V]
logits, jitted and timed alone at each of `mask_batches`, against the target's forward of [B, K + 1]
tokens (`costs.forward_seconds`), the least a round costs.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import jsonschema
import ml_collections
import numpy as np

import specjax
from experiments import harness
from experiments.harness import number
from specjax import costs
from specjax.constraints import compiler
from specjax.constraints.mask import forced_tokens
from specjax.decode_config import default_config

_PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"}}, "required": ["name", "age", "city"]
}
_WEATHER_CALL = {
    "type": "object", "properties": {
        "name": {"const": "get_weather"}, "arguments": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]
        }
    }, "required": ["name", "arguments"]
}
REQUESTS = [  # (prompt, schema)
    ("Extract the person as JSON with name, age and city: Maria Silva is 34 and lives in Lisbon.", _PERSON),
    ("Extract the person as JSON with name, age and city: Kenji, aged 51, moved to Osaka last year.", _PERSON),
    ("Extract the product as JSON: The ACME X200 drill costs 89.90 dollars and is in stock.", {
        "type": "object",
        "properties": {"product": {"type": "string"}, "price": {"type": "number"},
                       "in_stock": {"type": "boolean"}}, "required": ["product", "price", "in_stock"]
    }),
    ("Call the weather tool for Paris in celsius. Answer with the tool call as JSON.", _WEATHER_CALL),
    ("List the three primary colours as JSON.", {
        "type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string"}}},
        "required": ["colours"]
    }),
    ("Extract the meeting as JSON: Team sync on 2024-05-02 at 10:30 with Ana and Bo.", {
        "type": "object", "properties": {
            "title": {"type": "string"}, "date": {"type": "string"}, "time": {"type": "string"},
            "people": {"type": "array", "items": {"type": "string"}}
        }, "required": ["title", "date", "time", "people"]
    }),
    ("Call the weather tool for Toronto in fahrenheit. Answer with the tool call as JSON.", _WEATHER_CALL),
    ("Extract the book as JSON: 'Dune' by Frank Herbert, published 1965, 412 pages.", {
        "type": "object", "properties": {
            "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
            "pages": {"type": "integer"}
        }, "required": ["title", "author", "year", "pages"]
    }),
]

# Tree systems: (drafter, config.tree); K is the tree's depth, the policy fixed (a dynamic tree needs it).
TREES = {
    "model_tree": ("model", "(2, 1, 1, 1, 1)"), "model_dynamic": ("model", "dynamic(8, 5, 2)"),
    "ngram_tree": ("ngram", "(2, 1, 1, 1, 1)")
}


def _system_fields(system: str) -> dict:
  """The decode fields of a system name."""
  if system in TREES:
    drafter, tree = TREES[system]
    return {"mode": "speculative", "drafter": drafter, "tree": tree, "k": 5, "k_policy": "fixed"}
  if system == "autoregressive":
    return {"mode": "autoregressive"}
  if system == "ngram":
    return {"mode": "speculative", "drafter": "ngram", "k": 5, "k_policy": "fixed"}
  if system == "model_adaptive":
    return {"mode": "speculative", "drafter": "model", "k": 5, "k_policy": "adaptive"}
  if system.startswith("model_k"):
    return {"mode": "speculative", "drafter": "model", "k": int(system[len("model_k"):]), "k_policy": "fixed"}
  raise ValueError(f"config.systems: unknown system {system!r}")


def _valid(text: str, schema: dict) -> bool:
  try:
    jsonschema.validate(json.loads(text), schema)
    return True
  except (json.JSONDecodeError, jsonschema.ValidationError):
    return False


def _forced_share(table: compiler.RunConstraints, specs: list[str], outputs: list[list[int]]) -> float:
  """The share of generated tokens at which the row's constraint allowed exactly one token, counted on
  the host from the outputs (`mask.forced_tokens`)."""
  forced_Z = forced_tokens(table.next_ZxV)
  forced = total = 0
  for spec, ids in zip(specs, outputs):
    state = table.start_of[spec]
    for token in ids:
      forced += int(forced_Z[state] >= 0)
      total += 1
      state = table.next_ZxV[state, token]
  return forced / max(total, 1)


def _mask_seconds(table: compiler.RunConstraints, spec: str, batch: int, k: int, vocab: int) -> float:
  """Mean seconds of the verify pass's masking of [batch, k + 1, vocab] logits (jitted, 20 calls)."""
  constraint = table.rows([spec] * batch)
  masked = jax.jit(lambda c, tokens, logits: c.along(tokens).mask(logits))
  tokens = jnp.zeros((batch, k), jnp.int32)
  logits = jax.random.normal(jax.random.key(0), (batch, k + 1, vocab))
  jax.block_until_ready(masked(constraint, tokens, logits))
  start = time.perf_counter()
  for _ in range(20):
    jax.block_until_ready(masked(constraint, tokens, logits))
  return (time.perf_counter() - start) / 20


def run(cfg: ml_collections.ConfigDict, log=harness.log) -> dict:
  requests = REQUESTS[:cfg.num_requests]
  specs = ["json_schema:" + json.dumps(schema) for _, schema in requests]
  decode = default_config()
  models = any(system.startswith("model") for system in cfg.systems)  # else no draft model is loaded
  decode.update(target=cfg.target, draft=cfg.draft if models else "", drafter="model" if models else "ngram",
                dtype=cfg.dtype, max_new_tokens=cfg.max_new_tokens, k_policy="fixed",
                prompts=tuple(p for p, _ in requests))
  dec = specjax.Decoder(config=decode, log=log)
  tok = dec.target.tokenizer
  directory = tempfile.mkdtemp(prefix="constraints-")
  files = {}
  for constrained in (False, True):
    files[constrained] = os.path.join(directory, f"requests_{constrained}.jsonl")
    with open(files[constrained], "w") as f:
      f.writelines(
          json.dumps({"prompt": p, **({"constraint": s} if constrained else {})}) + "\n"
          for (p, _), s in zip(requests, specs))
  table = compiler.for_run(specs, compiler.token_strings(tok, dec.target.config.vocab_size), tok.eos_ids)
  results = {
      "config": cfg.to_dict(), "requests": [{"prompt": p, "schema": s} for p, s in requests],
      "table_states": int(table.next_ZxV.shape[0]), "runs": []
  }
  reference = {}
  for constrained in cfg.constrained:
    for system in cfg.systems:
      log(f"{system}, {'constrained' if constrained else 'unconstrained'} ...")
      out = dec.run(prompts_file=files[constrained], **_system_fields(system))
      ids = [o["token_ids"] for o in out["outputs"]]
      texts = [tok.decode([i for i in row if i not in tok.eos_ids]) for row in ids]
      finished = [bool(row) and row[-1] in tok.eos_ids for row in ids]
      stats = out["stats"]
      row = {
          "system": system, "constrained": constrained, "tokens_per_second": stats["tokens_per_second"],
          "generated_tokens": stats["generated_tokens"], "wall_time_s": stats["wall_time_s"],
          "target_calls": stats["target_calls"], "compile_time_s": stats["compile_time_s"],
          "alpha_hat": stats.get("alpha_hat"), "tau": stats.get("mean_accepted_length"),
          "finished_rate": float(np.mean(finished)),
          "valid_rate": float(np.mean([f and _valid(t, s) for f, t, (_, s) in zip(finished, texts, requests)])
                             ), "forced_share": _forced_share(table, specs, ids) if constrained else None,
          "jump_forward_share": stats.get("jump_forward_share") if constrained else None, "texts": texts,
          "token_ids": ids
      }
      if system == "autoregressive":
        reference[constrained] = ids
      elif constrained in reference:
        row["equals_autoregressive"] = ids == reference[constrained]
      results["runs"].append(row)
      log(f"  {number(row['tokens_per_second'])} tokens/s, valid {row['valid_rate']:.2f}, tau {number(row['tau'])}")
      harness.write_results(results, cfg.output)
  target, k = dec.target, 5
  results["mask_cost"] = [{
      "batch": b, "k": k, "mask_s": _mask_seconds(table, specs[0], b, k, target.config.vocab_size),
      "verify_s": costs.forward_seconds(target.config, target.params, [k + 1], repeats=5, batch_size=b)[k + 1]
  } for b in cfg.mask_batches]
  harness.write_results(results, cfg.output)
  return results


def tables(results: dict) -> str:
  lines = [
      *harness.provenance(results), "",
      "| system | constrained | tokens/s | valid | finished | alpha_hat | tau | forced share "
      "| jump-forward (loop) | = AR |", "|---|---|---|---|---|---|---|---|---|---|"
  ]
  for r in results["runs"]:
    lines.append(f"| {r['system']} | {r['constrained']} | {number(r['tokens_per_second'])} | {r['valid_rate']:.2f} | "
                 f"{r['finished_rate']:.2f} | {number(r['alpha_hat'])} | {number(r['tau'])} | "
                 f"{number(r['forced_share'])} | {number(r.get('jump_forward_share'))} | "
                 f"{r.get('equals_autoregressive', '')} |")
  for m in results.get("mask_cost", []):
    lines.append(f"\nmask at batch {m['batch']}, K = {m['k']}: {m['mask_s'] * 1e3:.2f} ms, "
                 f"{m['mask_s'] / m['verify_s']:.2%} of the target's verify pass ({m['verify_s'] * 1e3:.1f} ms)")
  return "\n".join(lines)


def main(cfg: ml_collections.ConfigDict) -> None:
  harness.report_or_run(cfg, run, tables)


if __name__ == "__main__":
  harness.run_script(main, "constraints benchmark config (configs/benchmarks/constraints.py).")
