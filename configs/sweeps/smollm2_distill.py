"""Distillation before/after on SmolLM2-135M-Instruct (configs/distill_smollm2.py): the
layer-truncated 4-block draft undistilled (step 0) and distilled (step 1000), K = 1, 2, 3, greedy and
temperature 1, batch 1, with the drafts' heads restricted to the 8,192 tokens most frequent in the
run's training files (the full head is 28M of a draft's 42M parameters: c ~0.21-0.25 with it, ~0.17
without; `--config.axes.model.vocab='(0, 8192)'` runs both), plus the target's autoregressive baseline,
on 4 held-out prompts. About 10 minutes alone on 2 CPU cores.

Needs the distillation's work directory: the training run, then
`python -m experiments.distill_smollm2.report --config=configs/reports/distill.py:distill_smollm2`, which
writes both drafts (`drafts/step0`, `drafts/step<N>` for the latest checkpoint N), the held-out prompts
and the training-file corpus there. For a run stopped early:
`--config.axes.draft='("WORKDIR/drafts/step0", "WORKDIR/drafts/stepN")'`.

  python -m experiments.sweep --config=configs/sweeps/smollm2_distill.py
  python -m experiments.plots --config=configs/reports/plots.py:smollm2_distill   # drafts named, K = 1
"""

import ml_collections

from configs import qwen_coder

WORKDIR = "experiments/distill_smollm2/workdir"  # configs/distill_smollm2.py's run, as its README runs it


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.base = qwen_coder.get_config()  # every decode field; configs/qwen_coder.py documents them
  cfg.base.k_policy = "fixed"  # K tokens every round: the points measure each K (the default adapts)
  cfg.base.target = "smollm2-135m-instruct"  # the distillation's target (registry name)
  cfg.base.draft = f"{WORKDIR}/drafts/step1000"  # replaced by the draft axis
  cfg.base.prompts_file = f"{WORKDIR}/heldout_prompts.jsonl"  # 128-token prefixes of held-out stdlib files
  cfg.base.chat = False  # plain code continuation, as in training
  cfg.base.max_new_tokens = 96  # budget per prompt
  cfg.base.batch_size = 1  # one prompt at a time: the latency regime of speculative decoding
  cfg.base.model.vocab = 8192  # the draft's head scores the 8,192 most frequent tokens of ...
  cfg.base.model.vocab_corpus = f"{WORKDIR}/train_corpus.jsonl"  # ... the training files
  cfg.axes = ml_collections.ConfigDict()  # decode field -> values; the grid is their cartesian product
  cfg.axes.mode = ("autoregressive", "speculative")  # the baseline runs once per temperature
  cfg.axes.draft = (f"{WORKDIR}/drafts/step0", f"{WORKDIR}/drafts/step1000")  # before / after distillation
  cfg.axes.k = (1, 2, 3)  # draft tokens per round (alpha ~ 0.3 favours small K)
  cfg.axes.temperature = (0.0, 1.0)  # greedy and plain sampling
  cfg.output = "experiments/results/sweep_smollm2_distill.jsonl"  # JSONL table, one row per point
  cfg.measure_cost = True  # the draft/target cost ratio c, through the restricted head when there is one
  cfg.cost_repeats = 10  # timed 1-token forwards per model (the median is kept)
  return cfg
