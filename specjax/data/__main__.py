"""`python -m specjax.data {list, fetch NAME [NAME ...]}`: the named benchmark datasets and their cache."""

from __future__ import annotations

import argparse
import sys

from specjax.data import registry


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m specjax.data", description=__doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  commands.add_parser("list", help="show the named datasets and whether they are installed")
  fetch = commands.add_parser("fetch", help="download, sha256-check and extract named datasets")
  fetch.add_argument("names", nargs="+", metavar="NAME", choices=sorted(registry.DATASETS))
  args = parser.parse_args(argv)

  if args.command == "list":
    for spec in registry.DATASETS.values():
      state = "installed" if registry.is_installed(spec) else "not installed"
      print(f"  {spec.name:12s} {state:13s}  {spec.description}  ({registry.data_path(spec)})")
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
