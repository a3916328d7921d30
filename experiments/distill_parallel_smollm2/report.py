"""PARD against an autoregressive draft on SmolLM2-135M-Instruct: the latest checkpoints of the two runs
of configs/distill_smollm2_parallel.py (same draft, data, optimiser and steps), decoded greedily at K
on held-out stdlib prompts: the target alone; the autoregressive draft (`drafter = "model"`); the PARD
draft in one pass per round (`drafter = "parallel"`) and, for reference, drafting autoregressively.

Per run: tokens/s, τ (mean tokens committed per round), per-position acceptance, draft passes per round,
whether the greedy output equals the target's; per draft, its held-out evaluations (first, latest) and
the timed draft forward of 1, 2 and 2K tokens, from which a round's draft cost: the chain's catch-up
(2 tokens) plus K - 1 single passes, against the parallel pass of 2K tokens. Settings:
configs/reports/distill_parallel.py.

  python -m experiments.distill_parallel_smollm2.report --config=configs/reports/distill_parallel.py
"""

from __future__ import annotations

import json
import os

import ml_collections

from configs import distill_smollm2_parallel, qwen_coder
from experiments import harness
from experiments.distill_smollm2.report import heldout_evals, held_out_prompts, split, write_jsonl
from specjax import costs, pipeline, records
from specjax.distill import pard, train
from specjax.distill.export import export_hf
from specjax.speculative.drafters.parallel import save_mask_token

# (name, drafter, which run's draft)
SYSTEMS = (("autoregressive draft", "model", "autoregressive"), ("parallel draft", "parallel", "parallel"),
           ("parallel draft, drafting autoregressively", "model", "parallel"))


def export_latest(variant: str, workdir: str) -> tuple[str, dict]:
  """The run's latest checkpoint as an HF directory (with its mask token for a parallel draft); its facts."""
  config = distill_smollm2_parallel.get_config(variant)
  config.workdir = workdir
  teacher, draft, step = train.latest(config)
  directory = export_hf(os.path.join(workdir, "drafts", f"step{step}"), draft.config, draft.params, teacher.tokenizer)
  if variant == "parallel":
    save_mask_token(directory, pard.mask_id(draft.config))
  evals = heldout_evals(workdir)
  return directory, {"step": step, "heldout_first": evals[0], "heldout_latest": evals[-1]}


def main(cfg: ml_collections.ConfigDict) -> None:
  drafts, results = {}, {"runs": [], "drafts": {}}
  for variant, workdir in cfg.workdirs.items():
    drafts[variant], results["drafts"][variant] = export_latest(variant, workdir)
  config = distill_smollm2_parallel.get_config()
  prompts_file = os.path.join(cfg.workdirs.parallel, "heldout_prompts.jsonl")
  _, held = split(config)
  base = qwen_coder.get_config()
  base.target, base.prompts_file, base.chat = config.target, prompts_file, False
  base.k_policy, base.k, base.temperature = "fixed", cfg.k, 0.0
  base.max_new_tokens, base.batch_size, base.mode = cfg.max_new_tokens, 1, "autoregressive"
  target, _ = pipeline.load_models(base)
  write_jsonl(({"prompt": p} for p in held_out_prompts(held, target.tokenizer, cfg.num_prompts, cfg.prompt_tokens)),
              prompts_file)
  baseline = pipeline.run(base, models=(target, None))
  ar_ids = [o["token_ids"] for o in baseline["outputs"]]
  results["runs"].append({"system": "target alone", **baseline["stats"]})
  for name, drafter, variant in SYSTEMS:
    spec = base.copy_and_resolve_references()
    spec.mode, spec.drafter, spec.draft = "speculative", drafter, drafts[variant]
    draft = pipeline.load_models(spec, target=target)[1]
    out = pipeline.run(spec, models=(target, draft))
    stats = out["stats"]
    rounds = stats["target_calls"] - stats["num_prompts"]  # each prompt's prefill is one target call
    results["runs"].append({
        "system": name, "drafter": drafter, "draft": records.relative(drafts[variant]),
        "greedy_equals_target": [o["token_ids"] for o in out["outputs"]] == ar_ids,
        "tau": stats["generated_tokens"] / max(rounds, 1),
        "draft_passes_per_round": stats["draft_calls"] / max(rounds, 1),
        "speedup_vs_target": stats["tokens_per_second"] / baseline["stats"]["tokens_per_second"], **stats
    })
    if variant == "parallel" and drafter == "parallel":
      seconds = costs.forward_seconds(draft.config, draft.params, (1, 2, 2 * cfg.k), cfg.cost_repeats)
      target_step = costs.forward_seconds(target.config, target.params, (1,), cfg.cost_repeats)[1]
      chain, parallel = seconds[2] + (cfg.k - 1) * seconds[1], seconds[2 * cfg.k]
      results["draft_cost_per_round"] = {
          "forward_seconds_by_width": {str(t): s for t, s in seconds.items()}, "target_step_seconds": target_step,
          "chain_seconds": chain, "parallel_seconds": parallel, "parallel_over_chain": parallel / chain,
          "note": "chain: a 2-token catch-up pass and K - 1 single passes; parallel: one pass of 2K tokens"
      }
    harness.log(f"{name}: {json.dumps({k: results['runs'][-1][k] for k in ('tau', 'tokens_per_second')})}")
  results["environment"] = records.environment()
  harness.write_results(results, cfg.output)
  print(f"wrote {cfg.output}", flush=True)


if __name__ == "__main__":
  harness.run_script(main, "Report config (configs/reports/distill_parallel.py).")
