"""`python -m specjax.distill --config=configs/distill_tiny.py --config.workdir=DIR [--config.FIELD=VALUE ...]`

Distils a draft toward a target as the config describes (fields: `specjax.distill.config`), resuming
from DIR's latest good checkpoint when there is one. Bad input (config values, unknown fields, data,
checkpoints, models) and a non-finite loss end with one `error: ...` line (`specjax.cli`; exit status 2
for the config, 1 for the rest); `SPECJAX_DEBUG=1` shows the traceback. Library logs (orbax's, at INFO)
are shown with `--verbosity=0`.
"""

from __future__ import annotations

from ml_collections import config_flags

from specjax import cli, mesh
from specjax.distill import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "distillation config file (configs/distill_*.py)",
                                          lock_config=True)


def main(config):
  mesh.initialize_distributed()  # a multi-process launch (coordinator, SLURM, TPU pod) joins here
  return train.run(config)


if __name__ == "__main__":
  cli.run(main, _CONFIG)
