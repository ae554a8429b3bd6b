"""Run a command while busy loops keep every core of this machine busy: the suite must hold
on a loaded CI machine (``make test-loaded`` runs ``make test``'s pytest under it).

    python scripts/loaded.py [--loops N] -- <command ...>

Starts ``N`` (default: the number of cores) processes that spin in pure Python, runs the
command, and kills the loops however this script ends (SIGKILL in a ``finally``, and each
loop dies with this process through ``PR_SET_PDEATHSIG`` on Linux). Prints the command's wall
time and exits with its exit code.
"""

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

SPIN = "while True: pass"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loops", type=int, default=os.cpu_count() or 1,
                   help="busy loops to run beside the command (default: one per core)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("the command to run follows --")
    if args.loops < 0:
        p.error(f"--loops must be >= 0, got {args.loops}")
    loops = [subprocess.Popen([sys.executable, "-c", SPIN], preexec_fn=_die_with_parent)
             for _ in range(args.loops)]
    t0 = time.perf_counter()
    try:
        rc = subprocess.call(cmd)
    finally:
        for proc in loops:
            proc.kill()
            proc.wait()
    print(f"loaded.py: {' '.join(cmd)} exited {rc} after {time.perf_counter() - t0:.0f} s "
          f"beside {args.loops} busy loop(s)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
