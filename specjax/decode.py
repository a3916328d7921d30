"""`python -m specjax.decode --config=configs/<name>.py [--config.field=value ...]`.

A thin absl app over `specjax.Decoder`: it parses the locked ml_collections config, loads the models
(`Decoder.from_config`), decodes the config's prompts (`Decoder.run`) and prints the generated texts and
a stats table. Bad input (an unknown or invalid field, a missing or
malformed prompts file, an unwritable output, a model that cannot be loaded) ends with one `error: ...`
line (`specjax.cli`); `SPECJAX_DEBUG=1` shows the traceback instead.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_flags

from specjax import cli, decode_config, mesh
from specjax.api import Decoder
from specjax.speculative import k_policy

_CONFIG = config_flags.DEFINE_config_file("config", None, "Decode config file (see configs/).", lock_config=True)


def _print_stats(stats: dict) -> None:
  rows = [("mode", stats["mode"]), ("prompts", stats["num_prompts"]), ("generated tokens", stats["generated_tokens"]),
          ("tokens / s", f"{stats['tokens_per_second']:.2f}"), ("wall time (s)", f"{stats['wall_time_s']:.2f}"),
          ("compile time (s)", f"{stats['compile_time_s']:.2f}"), ("target calls", stats["target_calls"])]
  if stats["mode"] == "speculative":
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"
    rows += [("draft calls", stats["draft_calls"]), ("acceptance rate", fmt(stats["acceptance_rate"])),
             ("alpha_hat", fmt(stats["alpha_hat"])), ("mean accepted length", fmt(stats["mean_accepted_length"])),
             ("per-position acceptance", " ".join(fmt(x) for x in stats["per_position_acceptance"]))]
    if "nodes_verified_per_round" in stats:  # a tree: the positions above are its depths
      rows += [("nodes verified / round", fmt(stats["nodes_verified_per_round"])),
               ("accepted / verified node", fmt(stats["accepted_per_verified_node"]))]
    rows += _policy_rows(stats["k_policy"])
  width = max(len(name) for name, _ in rows)
  for name, value in rows:
    print(f"  {name:<{width}}  {value}")


def _policy_rows(policy: dict) -> list[tuple[str, str]]:
  """The K policy's rows: its kind, and for the adaptive one the rounds that chose each length and the
  cost table (measured now, in how long, or stored by an earlier run)."""
  lengths, labels = policy["lengths"], k_policy.labels(policy)
  if policy["kind"] != "adaptive":
    return [("k policy", f"fixed, K = {lengths[0]}")]
  return [("k policy", f"adaptive, K <= {lengths[-1]}"),
          ("rounds per length", "  ".join(f"{n}: {r}" for n, r in zip(labels, policy["rounds_per_length"]))),
          ("round cost (ms)", "  ".join(f"{n}: {1e3 * c:.1f}" for n, c in zip(labels, policy["cost_table_s"])) +
           f"  ({k_policy.tuning.cost_table_source(policy)})")]


def main(cfg: ml_collections.ConfigDict) -> None:
  mesh.initialize_distributed()  # a multi-process launch (coordinator, SLURM, TPU pod) joins here
  results = Decoder.from_config(cfg, log=lambda message: print(message, flush=True)).run()
  if not mesh.is_main_process():  # process 0 prints and writes for all
    return
  for number, out in enumerate(results.get("outputs", ()), 1):  # none with config.lower_only
    print(f"\n=== prompt {number}: {out['prompt'][:70]!r}\n{out['text']}")
  if "stats" in results:
    print()
    _print_stats(results["stats"])
  if cfg.output and results["written_to"] != cfg.output:
    where = (f"they were written to {results['written_to']} instead"
             if results["written_to"] else "nor could the fallback file be written; the texts are above")
    cli.fail(f"could not write the results to config.output {cfg.output}; {where}", cli.DATA)


if __name__ == "__main__":
  cli.run(main, _CONFIG, moved=decode_config.moved)
