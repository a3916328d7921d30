"""`python -m specjax.distill --config=configs/distill_tiny.py --config.workdir=DIR [--config.FIELD=VALUE ...]`

Distils a draft toward a target as the config describes (fields: `specjax.distill.config`), resuming
from DIR's latest checkpoint when there is one. A configuration error exits with its message, not
a traceback. Library logs (orbax's, at INFO) are shown with `--verbosity=0`.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from specjax.distill import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "distillation config file (configs/distill_*.py)",
                                          lock_config=True)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; settings go in --config.FIELD=VALUE")
  if _CONFIG.value is None:
    raise app.UsageError("--config=configs/<name>.py is required")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; progress goes to stdout
  try:
    train.run(_CONFIG.value)
  except (ValueError, FileNotFoundError, PermissionError, FloatingPointError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
