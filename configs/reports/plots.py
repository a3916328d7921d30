"""Figures of a sweep table (`python -m experiments.plots --config=configs/reports/plots.py:<sweep>`),
`<sweep>` naming a config of configs/sweeps/; the committed figures' settings are presets:

  python -m experiments.plots --config=configs/reports/plots.py:qwen_coder_k     # plots/k_sweep, K = 5
  python -m experiments.plots --config=configs/reports/plots.py:qwen_coder_batch # plots/batch_sweep
  python -m experiments.plots --config=configs/reports/plots.py:smollm2_distill  # drafts named, K = 1
  python -m experiments.plots --config=configs/reports/plots.py:smollm2_eagle
  python -m experiments.plots --config=configs/reports/plots.py --config.table=T.jsonl --config.output=DIR
"""

from configs.reports import sweep as sweep_report
from configs.sweeps import smollm2_distill

PLOTS = "experiments/results/plots"
PRESETS = {  # sweep -> the fields that differ from the defaults, as the committed figures were made
    "qwen_coder_k": dict(output=f"{PLOTS}/k_sweep", k=5),
    "qwen_coder_batch": dict(output=f"{PLOTS}/batch_sweep"),
    "smollm2_distill": dict(k=1, labels=(f"{smollm2_distill.WORKDIR}/drafts/step0=undistilled",
                                         f"{smollm2_distill.WORKDIR}/drafts/step1000=distilled")),
}


def get_config(sweep: str = ""):
  cfg = sweep_report.get_config(sweep)  # table: the JSONL table (required)
  cfg.output = f"{PLOTS}/{sweep}" if sweep else ""  # directory of the PNG files (required; made if missing)
  cfg.k = 0  # K of the per-position and per-draft figures (0 = the largest K in the table)
  cfg.labels = ()  # "DRAFT=NAME" each: the name of a draft axis value (e.g. a path) in legends and bars
  cfg.update(PRESETS.get(sweep, {}))
  return cfg
