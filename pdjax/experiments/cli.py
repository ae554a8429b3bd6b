"""Command line: ``pdjax run experiments/quickstart.toml`` (also ``python -m pdjax``)."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pdjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run an experiment config (TOML)")
    p_run.add_argument("config", help="path to an experiments/*.toml file")
    p_run.add_argument("--runs-dir", default="runs", help="where run directories go (default: runs)")
    sub.add_parser("serve", add_help=False,
                   help="one role of the two-process PD server (see pdjax serve --help)")
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # Experiments that run meshes on the CPU want 8 host devices; XLA reads this flag when the
    # CPU backend starts (the first device query), which has not happened yet here.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    if args.command == "serve":
        from pdjax.disagg.serve import main as serve
        return serve(rest)
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
