"""The adaptive K policy's estimator settings on simulated acceptance
(`python -m experiments.simulate_k_policy --config=configs/searches/k_policy.py`)."""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.k = 8  # the most draft tokens a round proposes (lengths 0, 1, 2, 3, 5, 8)
  # Seconds per round at each length: the Qwen pair's table measured by the adaptive run of chat/sampled in
  # the adaptive benchmark's first run at commit 64bcc4b (batch 1, T = 1, 2-core CPU; in git history).
  cfg.cost_table_s = (0.179, 0.513, 0.439, 0.474, 0.612, 0.793)
  cfg.plain_step_s = 0.150  # a plain target step on the same run (6.6 tokens/s autoregressive)
  cfg.alphas = (0.5, 0.77, 0.88, 0.95)  # per-position acceptance: poor, raw code, chat at T = 1, chat greedy
  cfg.decays = (0.8, 0.9, 0.95)  # adaptive.decay values compared
  cfg.recoveries = (0.02, 0.05)  # adaptive.recovery values compared
  cfg.prior = 0.8  # adaptive.prior
  cfg.rounds = 4000  # simulated rounds per setting
  cfg.seed = 0
  cfg.output = "experiments/results/k_policy_simulation.json"
  cfg.report = ""  # a results file to print the table of, instead of running
  return cfg
