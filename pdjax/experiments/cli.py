"""Command line (also ``python -m pdjax``):

    pdjax run <experiment or path.toml> [--set table.key=value ...] [--runs-dir runs] [--quiet]
    pdjax report runs/<name>/<timestamp>
    pdjax list [directory]
    pdjax launch --num-processes N [--devices-per-process D] [--timeout S] -- <command ...>

``run`` takes an experiment's name (``pdjax list`` shows them: the configs that ship with
pdjax, runnable from any directory) or a path to a TOML file. It checks the config against
its experiment's schema (an error names the key and exits with status 2 before anything
runs), runs it into runs/<name>/<timestamp>/ (config.json, metrics.json, CSV tables, PNG and
SVG plots, report.md) with progress bars on stderr, and prints the report. A run that fails
after that leaves its directory marked FAILED and exits with status 1. ``--quiet``: no
progress bars and only the report's path on stdout. ``report`` rebuilds a run directory's
report.md from its saved files (or says that the run failed).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    """The ``pdjax`` command; Ctrl-C ends any subcommand with one line on stderr and exit
    code 130 (a run directory it had started is marked FAILED, see rundir.running)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("pdjax: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:              # its command follows --: parsed on its own
        from pdjax.cluster.launch import main as launch
        return launch(argv[1:])
    parser = argparse.ArgumentParser(prog="pdjax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run an experiment (its name, or a TOML config)")
    p_run.add_argument("config", help="an experiment name (pdjax list) or a path to a TOML config")
    p_run.add_argument("--runs-dir", default="runs", help="where run directories go (default: runs)")
    p_run.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                       help="override a config value (TOML syntax: 8, 0.5, true, [1, 2], \"1f1b\"); repeatable; "
                            "top-level keys too, e.g. scale=4")
    p_run.add_argument("-q", "--quiet", action="store_true",
                       help="no progress bars; print only the report's path")
    p_report = sub.add_parser("report", help="rebuild a run directory's report.md from its saved files")
    p_report.add_argument("run_dir", help="a run directory, runs/<name>/<timestamp>")
    p_list = sub.add_parser("list", help="list the experiments that ship with pdjax (or a directory's configs)")
    p_list.add_argument("directory", nargs="?", default=None)
    sub.add_parser("launch", add_help=False, help="a local cluster of processes running one command "
                                                   "(see pdjax launch --help)")
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
    if args.command == "list":
        return _list(args.directory)
    if args.command == "report":
        return _report(args.run_dir)
    return _run(args)


def _list(directory) -> int:
    from pdjax.experiments.runner import list_experiments
    try:
        rows = list_experiments(directory)
    except (FileNotFoundError, NotADirectoryError):
        print(f"pdjax: no directory {directory}", file=sys.stderr)
        return 2
    if directory is None:      # a shipped config is named after its kind: the name once
        head, lines = ("experiment", "description"), [(where, description) for where, _, description in rows]
    else:
        head, lines = ("config", "kind", "description"), rows
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(head[:-1])]
    for line in (head, *lines):
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(line, widths)) + "  " + line[-1])
    return 0


def _report(run_dir: str) -> int:
    from pdjax.experiments.runner import rebuild_report
    from pdjax.experiments.rundir import RunFailed
    try:
        path = rebuild_report(run_dir)
    except FileNotFoundError as e:
        print(f"pdjax: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"pdjax: {e}", file=sys.stderr)
        return 1
    print(f"report: {path}")
    return 0


def _run(args) -> int:
    from pdjax.experiments.runner import run
    from pdjax.experiments.rundir import RunFailed
    try:
        run_dir, result = run(args.config, args.runs_dir, args.set, show_progress=not args.quiet)
    except (ValueError, FileNotFoundError) as e:          # before the run directory exists
        print(f"pdjax: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"pdjax: {args.config}: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"# {result.title}\n\n{result.headline}\n\n{result.body}\n")
    print(f"report: {os.path.join(run_dir, 'report.md')}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
