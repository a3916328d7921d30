"""The adaptive K policy on simulated acceptance: which estimator settings (`adaptive.decay`,
`adaptive.recovery`) keep it at the best fixed length, before a real run spends an hour finding out.

  python -m experiments.simulate_k_policy --config=configs/searches/k_policy.py

Each draft position is accepted with probability alpha, independently (Leviathan et al.'s model; real
text is burstier, which favours faster estimates). The policy is the library's own (`KPolicy.choose`
and `update`, jitted, one row), choosing among its lengths under a measured cost table (seconds per round
at each length, e.g. a benchmark's `cost_table_s`) for `rounds` rounds; its throughput is reported as a
multiple of a plain step's (`plain_step_s`), next to the best fixed length's expected throughput under
the same table. One JSON file (`output`) and a markdown table.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import harness
from specjax.speculative.k_policy import Adaptive, KPolicy, Tables


def simulate(policy: KPolicy, k: int, cost_C: np.ndarray, alpha: float, rounds: int, seed: int) -> dict:
  """Tokens per second of `policy` over `rounds` simulated rounds, and the share of rounds per length."""
  candidates = policy.candidates(k)
  lengths_C = jnp.asarray(policy.lengths(k))

  def round_(state, key):
    live_B = jnp.ones((1,), bool)
    plan, index = policy.choose(state, live_B, candidates)
    wanted_B = plan.clip(jnp.full((1,), k, jnp.int32))
    accepted_K = jax.random.uniform(key, (k,)) < alpha
    num_accepted = jnp.minimum(jnp.sum(jnp.cumprod(accepted_K)), wanted_B[0])
    state = policy.update(state, index, wanted_B[None], num_accepted[None, None], live_B)
    return state, (num_accepted + 1, state.cost_C[index])

  state = policy.init(1, candidates, Tables(cost_C, np.full((1, k), policy.prior, np.float32)))
  state, (tokens_R,
          seconds_R) = jax.jit(lambda s: jax.lax.scan(round_, s, jax.random.split(jax.random.key(seed), rounds)))(state)
  chosen = np.asarray(state.chosen_C) / rounds
  return {
      "tokens_per_second": float(jnp.sum(tokens_R) / jnp.sum(seconds_R)),
      "share_per_length": dict(zip(map(str,
                                       np.asarray(lengths_C).tolist()),
                                   chosen.round(4).tolist()))
  }


def best_fixed(policy: KPolicy, k: int, cost_C: np.ndarray, alpha: float) -> tuple[int, float]:
  """The length with the most expected tokens per second under the table, and that rate."""
  rates = [(1 + sum(alpha**j for j in range(1, n + 1))) / c for n, c in zip(policy.lengths(k), cost_C)]
  return policy.lengths(k)[int(np.argmax(rates))], float(max(rates))


def run(cfg: ml_collections.ConfigDict, log: harness.Log = harness.log) -> dict:
  cost_C = np.asarray(cfg.cost_table_s, np.float32)
  lengths = Adaptive().lengths(cfg.k)
  if len(cost_C) != len(lengths) or not (cost_C > 0).all():
    raise ValueError(f"config.cost_table_s must hold {len(lengths)} positive costs (lengths {lengths})")
  rows = []
  for alpha, decay, recovery in itertools.product(cfg.alphas, cfg.decays, cfg.recoveries):
    policy = Adaptive(prior=cfg.prior, decay=decay, recovery=recovery)
    length, rate = best_fixed(policy, cfg.k, cost_C, alpha)
    got = simulate(policy, cfg.k, cost_C, alpha, cfg.rounds, cfg.seed)
    rows.append({
        "alpha": alpha, "decay": decay, "recovery": recovery, "best_fixed_length": length,
        "best_fixed_vs_plain": rate * cfg.plain_step_s,
        "adaptive_vs_plain": got["tokens_per_second"] * cfg.plain_step_s, "share_per_length": got["share_per_length"]
    })
    log(f"alpha {alpha} decay {decay} recovery {recovery}: adaptive {rows[-1]['adaptive_vs_plain']:.3f}x plain, "
        f"best fixed (L={length}) {rows[-1]['best_fixed_vs_plain']:.3f}x")
  results = {"config": cfg.to_dict(), "rows": rows}
  harness.write_results(results, cfg.output)
  return results


def table(results: dict) -> str:
  lines = [
      f"Command: `{results['command']}`", "", "| α | decay | recovery | adaptive / plain | best fixed L | "
      "best fixed / plain | adaptive / best fixed | share of L = 0 |", "|" + "---|" * 8
  ]
  for r in results["rows"]:
    lines.append(f"| {r['alpha']:g} | {r['decay']:g} | {r['recovery']:g} | {r['adaptive_vs_plain']:.3f} | "
                 f"{r['best_fixed_length']} | {r['best_fixed_vs_plain']:.3f} | "
                 f"{r['adaptive_vs_plain'] / r['best_fixed_vs_plain']:.3f} | {r['share_per_length']['0']:.2f} |")
  return "\n".join(lines)


def main(cfg: ml_collections.ConfigDict) -> None:
  harness.report_or_run(cfg, run, table)


if __name__ == "__main__":
  harness.run_script(main, "Simulation config (configs/searches/k_policy.py).")
