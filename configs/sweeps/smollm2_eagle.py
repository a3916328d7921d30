"""The EAGLE head of configs/distill_eagle_smollm2.py decoding for SmolLM2-135M-Instruct: chains of
K = 1-4, two static trees of depth 4 (children drawn without replacement at T = 1) and a dynamic one (the
head's most likely children), greedy and temperature 1, batch 1, the head scoring through the target's output
head restricted to the 8,192 tokens it trained over (a head exported without a vocabulary: the 8,192 most
frequent in the run's training files, as the distilled drafts of `smollm2_distill.py`, so that c compares), plus
the target's autoregressive baseline, on the 4 held-out prompts that `smollm2_distill.py` decodes (the same
corpus split). About 15 minutes alone on 2 CPU cores.

Needs the run's work directory and `python -m experiments.distill_eagle_smollm2.report
--config=configs/reports/distill.py:distill_eagle_smollm2`, which exports
the newest checkpoint's head to `heads/step<N>` and writes the prompts and the corpus. For a run stopped
early: `--config.base.draft=WORKDIR/heads/stepN` (and a new `--config.output`: a table's points are not rerun).

  python -m experiments.sweep --config=configs/sweeps/smollm2_eagle.py
"""

import ml_collections

from configs import distill_eagle_smollm2, qwen_coder

WORKDIR = "experiments/distill_eagle_smollm2/workdir"  # the training run, as its README runs it


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.base = qwen_coder.get_config()  # every decode field; configs/qwen_coder.py documents them
  cfg.base.k_policy = "fixed"  # K tokens every round: the points measure each K (the default adapts)
  cfg.base.target = "smollm2-135m-instruct"  # the head's target (registry name)
  cfg.base.drafter = "eagle"  # a head reading the target's features
  cfg.base.draft = f"{WORKDIR}/heads/step{distill_eagle_smollm2.get_config().num_steps}"  # the finished run
  cfg.base.prompts_file = f"{WORKDIR}/heldout_prompts.jsonl"  # 128-token prefixes of held-out stdlib files
  cfg.base.chat = False  # plain code continuation, as in training
  cfg.base.max_new_tokens = 96  # budget per prompt
  cfg.base.batch_size = 1  # one prompt at a time: the latency regime of speculative decoding
  cfg.base.eagle.vocab = 8192  # the 8,192 tokens the head trained over (its own vocabulary); a head without one
  cfg.base.eagle.vocab_corpus = f"{WORKDIR}/train_corpus.jsonl"  # scores the most frequent of the training files
  cfg.base.tree_children = "without_replacement"  # tree children at T > 0: distinct draws
  cfg.axes = ml_collections.ConfigDict()  # decode field -> values; the grid is their cartesian product
  cfg.axes.mode = ("autoregressive", "speculative")  # the baseline runs once per temperature
  cfg.axes.k = (1, 2, 3, 4)  # draft tokens per round (chains)
  # chains; static trees of 14 and 24 nodes and a dynamic (EAGLE-2) tree of 14, all of depth 4
  cfg.axes.tree = ("", "(2, 2, 1, 1)", "(4, 2, 1, 1)", "dynamic(14, 4, 4)")
  cfg.axes.temperature = (0.0, 1.0)  # greedy and plain sampling
  cfg.output = "experiments/results/sweep_smollm2_eagle.jsonl"  # JSONL table, one row per point
  cfg.measure_cost = True  # the head/target cost ratio c
  cfg.cost_repeats = 10  # timed 1-token forwards (the median is kept)
  return cfg
