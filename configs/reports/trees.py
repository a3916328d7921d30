"""Trees against chains (`python -m experiments.report_trees --config=configs/reports/trees.py`): the
tree sweep tables summarised, the forward costs of the widths they used measured on this machine, two
(or three) cost models, one JSON file, a markdown table and a figure.

  python -m experiments.report_trees --config=configs/reports/trees.py         # the Qwen pair's trees
  python -m experiments.report_trees --config=configs/reports/trees.py:ngram   # n-gram spines
  python -m experiments.report_trees --config=configs/reports/trees.py --config.reuse_costs=True \
      --config.accelerator=experiments/results/accelerator_h200.json   # re-render with a kit's costs
"""

import ml_collections

RESULTS = "experiments/results"
VARIANTS = {  # variant -> (sweep tables, results file, figure)
    "qwen": ((f"{RESULTS}/sweep_qwen_coder_trees.jsonl", f"{RESULTS}/sweep_qwen_coder_trees_speed.jsonl"),
             f"{RESULTS}/trees_cpu.json", f"{RESULTS}/plots/trees.png"),
    "ngram": ((f"{RESULTS}/sweep_qwen_coder_ngram_trees.jsonl",), f"{RESULTS}/ngram_trees_cpu.json",
              f"{RESULTS}/plots/ngram_trees.png"),
}


def get_config(variant: str = "qwen"):
  tables, output, plot = VARIANTS[variant]
  cfg = ml_collections.ConfigDict()
  # Sweep tables (JSONL) whose speculative rows are summarised; the decode config of the first names
  # the models whose forward costs are measured.
  cfg.tables = tables
  cfg.output = output  # the JSON results (rows, forward seconds, comparisons)
  cfg.repeats = 5  # timed forwards per width (the median is kept)
  cfg.reuse_costs = False  # take the forward costs from `output` instead of measuring them (re-render)
  # A results file of experiments/benchmark_accelerator.py (its verify_costs and c): adds the
  # predicted_measured_accelerator column ("" = none).
  cfg.accelerator = ""
  cfg.plot = plot  # the figure (the batch-4 rows)
  return cfg
