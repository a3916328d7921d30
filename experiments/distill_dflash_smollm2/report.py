"""A DFlash block head against the committed EAGLE head on SmolLM2-135M-Instruct: the latest checkpoint of
configs/distill_dflash_smollm2.py and experiments/distill_eagle_smollm2/head, decoded greedily at K on
held-out stdlib prompts (the split both runs held out): the target alone, the EAGLE head (K head passes
per round), the DFlash head (one pass per round).

Per run: tokens/s, τ (mean tokens committed per round), per-position acceptance, draft passes per round,
whether the greedy output equals the target's; per head, the median time of one round's proposal (the
drafter's `propose` alone, jitted, after a prompt: both heads commit the same way, so the rest of a
round costs the same) against the target's one-token step. The committed EAGLE head scores the 8,192
tokens of its training rows; the DFlash head was trained over all 49,152 and decodes both ways: over all
of them, and through the `dflash_vocab` most frequent stdlib tokens (`dflash.vocab`: its output head cut
like EAGLE's, which is what the per-round cost compares like for like). The DFlash run's held-out evaluations
(first, latest) are recorded. Settings: configs/reports/distill_dflash.py.

  python -m experiments.distill_dflash_smollm2.report --config=configs/reports/distill_dflash.py
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import ml_collections

from configs import distill_dflash_smollm2, qwen_coder
from experiments import harness
from experiments.distill_smollm2.report import heldout_evals, held_out_prompts, split, write_jsonl
from specjax import costs, pipeline, records, session
from specjax.decode_spec import from_config
from specjax.distill import train
from specjax.models.kv_cache import init_cache
from specjax.sampling import sampling_params
from specjax.speculative.drafters.eagle_io import save_head
from specjax.speculative.plan import RoundPlan


def export_latest(workdir: str) -> tuple[str, dict]:
  """The run's latest checkpoint as a head directory; its facts."""
  config = distill_dflash_smollm2.get_config()
  config.workdir = workdir
  _, head_config, params, vocab, step = train.latest(config)
  directory = os.path.join(workdir, "heads", f"step{step}")
  save_head(directory, head_config, params, vocab)
  evals = heldout_evals(workdir)
  return directory, {"step": step, "heldout_first": evals[0], "heldout_latest": evals[-1]}


def proposal_seconds(drafter, target, prompt_ids: list[int], k: int, repeats: int) -> float:
  """The median time of one jitted `propose` of `drafter` (a head) after `prompt_ids`, greedy."""
  batch_prompts = jnp.asarray([prompt_ids], jnp.int32)
  state = drafter.init(drafter.storage(1,
                                       len(prompt_ids) + 2 * k + 2), batch_prompts,
                       jnp.asarray([len(prompt_ids)], jnp.int32), None)
  # The drafter is an argument (its weights traced), not a closed-over constant XLA would fold.
  propose = jax.jit(lambda drafter, state, pending_B, key: drafter.propose(state, init_cache(
      target.config, 1, 1), pending_B, sampling_params(0.0), key, RoundPlan(k))[0].tokens)
  pending_B, key = jnp.asarray([prompt_ids[-1]], jnp.int32), jax.random.key(0)
  propose(drafter, state, pending_B, key).block_until_ready()  # compile
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    propose(drafter, state, pending_B, key).block_until_ready()
    seconds.append(time.perf_counter() - start)
  return statistics.median(seconds)


def main(cfg: ml_collections.ConfigDict) -> None:
  dflash_dir, facts = export_latest(cfg.workdir)
  results = {
      "runs": [], "dflash_run": facts, "heads": {"eagle": cfg.eagle_head, "dflash": records.relative(dflash_dir)}
  }
  config = distill_dflash_smollm2.get_config()
  prompts_file = os.path.join(cfg.workdir, "heldout_prompts.jsonl")
  _, held = split(config)
  base = qwen_coder.get_config()
  base.target, base.prompts_file, base.chat = config.target, prompts_file, False
  base.k_policy, base.k, base.temperature = "fixed", cfg.k, 0.0
  base.max_new_tokens, base.batch_size, base.mode, base.dtype = cfg.max_new_tokens, 1, "autoregressive", cfg.dtype
  target, _ = pipeline.load_models(base)
  prompts = held_out_prompts(held, target.tokenizer, cfg.num_prompts, cfg.prompt_tokens)
  write_jsonl(({"prompt": p} for p in prompts), prompts_file)
  baseline = pipeline.run(base, models=(target, None))
  ar_ids = [o["token_ids"] for o in baseline["outputs"]]
  results["runs"].append({"system": "target alone", **baseline["stats"]})
  target_step = costs.forward_seconds(target.config, target.params, (1,), cfg.cost_repeats)[1]
  results["target_step_seconds"] = target_step
  systems = (("EAGLE head", "eagle", cfg.eagle_head, 0), ("DFlash head", "dflash", dflash_dir, 0),
             (f"DFlash head, {cfg.dflash_vocab}-token head", "dflash", dflash_dir, cfg.dflash_vocab))
  for name, drafter, head, vocab in systems:
    spec = base.copy_and_resolve_references()
    spec.mode, spec.drafter, spec.draft = "speculative", drafter, head
    spec.dflash.vocab = vocab
    built = session.build_drafter(from_config(spec), target, None)
    out = pipeline.run(spec, sessions=session.Sessions((target, None), built))
    stats = out["stats"]
    rounds = stats["target_calls"] - stats["num_prompts"]  # each prompt's prefill is one target call
    propose_s = proposal_seconds(built.drafter, target, target.tokenizer.encode(prompts[0]), cfg.k, cfg.cost_repeats)
    results["runs"].append({
        "system": name, "drafter": drafter, "draft": records.relative(head),
        **built.info, "greedy_equals_target": [o["token_ids"] for o in out["outputs"]] == ar_ids,
        "tau": stats["generated_tokens"] / max(rounds, 1),
        "draft_passes_per_round": stats["draft_calls"] / max(rounds, 1),
        "speedup_vs_target": stats["tokens_per_second"] / baseline["stats"]["tokens_per_second"],
        "proposal_seconds": propose_s, "proposal_over_target_step": propose_s / target_step, **stats
    })
    harness.log(f"{name}: "
                f"{json.dumps({k: results['runs'][-1][k] for k in ('tau', 'tokens_per_second', 'proposal_seconds')})}")
  results["environment"] = records.environment()
  harness.write_results(results, cfg.output)
  print(f"wrote {cfg.output}", flush=True)


if __name__ == "__main__":
  harness.run_script(main, "Report config (configs/reports/distill_dflash.py).")
