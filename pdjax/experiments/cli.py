"""Command line: ``pdjax run experiments/quickstart.toml`` (also ``python -m pdjax``)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pdjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run an experiment config (TOML)")
    p_run.add_argument("config", help="path to an experiments/*.toml file")
    p_run.add_argument("--runs-dir", default="runs", help="where run directories go (default: runs)")
    args = parser.parse_args(argv)
    if args.command == "run":
        from pdjax.experiments.runner import run
        try:
            out_dir, _ = run(args.config, args.runs_dir)
        except (ValueError, FileNotFoundError) as e:
            print(f"pdjax: {e}", file=sys.stderr)
            return 2
        print(f"\nreport: {out_dir}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
