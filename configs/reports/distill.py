"""The report of a distillation run (`python -m experiments.<run>.report --config=configs/reports/distill.py:<run>`),
`<run>` one of the directories `distill_smollm2`, `distill_eagle_smollm2` of experiments/:

  python -m experiments.distill_smollm2.report --config=configs/reports/distill.py:distill_smollm2
  python -m experiments.distill_eagle_smollm2.report --config=configs/reports/distill.py:distill_eagle_smollm2
"""

import ml_collections

RUNS = ("distill_smollm2", "distill_eagle_smollm2")


def get_config(run: str = ""):
  if run not in RUNS:
    raise ValueError(f"configs/reports/distill.py:<run>: run must be one of {', '.join(RUNS)}, got {run!r}")
  cfg = ml_collections.ConfigDict()
  cfg.workdir = f"experiments/{run}/workdir"  # the training run's work directory (checkpoints, metrics.jsonl)
  cfg.num_prompts = 4  # held-out prompts written for the decode sweep
  cfg.prompt_tokens = 128  # tokens of each held-out prompt (a prefix of a held-out document)
  cfg.output = f"experiments/{run}/results.json"  # the JSON results; curves.png is written next to it
  if run == "distill_eagle_smollm2":
    cfg.head = f"experiments/{run}/head"  # the newest head in bfloat16, committed ("" = not written)
  return cfg
