"""``pdjax launch`` as a user runs it: its processes die with it however it ends (SIGTERM,
SIGHUP, Ctrl-C: one line on stderr and exit 128 + the signal; SIGKILL: Linux kills them,
PR_SET_PDEATHSIG), ``--help`` prints the usage, a command that does not exist and a bad
option are one clear error before anything starts, and a stopped process (SIGSTOP) is named
when the cluster's heartbeat then aborts the healthy one.

The processes here never exit on their own (``signal.pause()``), so nothing passes by their
ending by themselves; every wait polls a condition under a generous deadline, and every
process still alive at the end is SIGKILLed."""

import io
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pdjax.cluster.children import process_state
from pdjax.cluster import LaunchError, launch
from pdjax.cluster.launch import main

PY = sys.executable
PAUSE = "import os, signal; print(os.getpid(), flush=True); signal.pause()"
DEADLINE_S = 90.0                       # a loaded machine starts three Pythons in far less


def _alive(pid: int) -> bool:
    """In the process table and not a zombie."""
    return process_state(pid) not in (None, "Z")


def _wait(condition, what: str, timeout: float = DEADLINE_S):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} not within {timeout:g} s"
        time.sleep(0.05)
    return value


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# SIGINT, SIGHUP, SIGTERM at their defaults in the launcher, even if this test run ignores them
# (a background job's SIGINT, nohup's SIGHUP): reset in a small exec wrapper, not a preexec_fn
# (which forks this multithreaded jax process)
DEFAULT_STOP_SIGNALS = ("import os, signal, sys\n"
                        "for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM): signal.signal(s, signal.SIG_DFL)\n"
                        "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def _start_launcher(tmp_path, n: int = 2):
    """``pdjax launch`` of ``n`` processes that never exit; returns (its Popen, the pids of
    its processes, its stderr path) once every process has printed its pid."""
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([PY, "-c", DEFAULT_STOP_SIGNALS, "-m", "pdjax", "launch", "--num-processes", str(n),
                                 "--", PY, "-c", PAUSE], stdout=o, stderr=e)

    def pids():
        found = dict(re.findall(r"^\[(\d+)\] (\d+)$", out.read_text(), re.M))
        assert proc.poll() is None, f"the launcher ended ({proc.returncode}): {err.read_text()}"
        return [int(p) for p in found.values()] if len(found) == n else None
    return proc, pids, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_launcher_stopped_by_a_signal_kills_its_processes_and_says_so_in_one_line(sig, tmp_path):
    """SIGTERM, SIGHUP, Ctrl-C: the launcher kills every process, prints one line (no
    traceback) and exits 128 + the signal."""
    proc, pids, err = _start_launcher(tmp_path)
    workers = []
    try:
        workers = _wait(pids, "both processes' pids")
        assert all(_alive(p) for p in workers)
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=DEADLINE_S) == 128 + sig
        lines = err.read_text().splitlines()
        assert lines == [f"pdjax launch: stopped by {sig.name}; every process of the launch was killed"], lines
        _wait(lambda: not any(_alive(p) for p in workers), "every process gone", 30)
    finally:
        _kill([proc.pid, *workers])
        proc.wait()


def test_a_launcher_killed_with_sigkill_takes_its_processes_with_it(tmp_path):
    """SIGKILL runs no handler: Linux kills the processes (PR_SET_PDEATHSIG)."""
    proc, pids, _ = _start_launcher(tmp_path)
    workers = []
    try:
        workers = _wait(pids, "both processes' pids")
        proc.kill()
        assert proc.wait(timeout=DEADLINE_S) == -signal.SIGKILL
        _wait(lambda: not any(_alive(p) for p in workers), "every process gone", 30)
    finally:
        _kill([proc.pid, *workers])
        proc.wait()


def test_help_prints_the_usage_and_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pdjax launch --num-processes N") and "-- command" in out and "--platform" in out
    run = subprocess.run([PY, "-m", "pdjax", "launch", "--help"], capture_output=True, text=True, timeout=DEADLINE_S)
    assert run.returncode == 0 and run.stdout.startswith("usage: pdjax launch") and run.stderr == ""


def test_a_command_that_does_not_exist_is_one_clear_error():
    with pytest.raises(LaunchError, match=r"cannot run 'nosuchcmd': no such executable on PATH$") as e:
        launch(["nosuchcmd", "--flag"], 2, stream=None)
    assert e.value.process is None
    with pytest.raises(LaunchError, match=r"cannot run '/no/such/dir/cmd': no such executable$"):
        launch(["/no/such/dir/cmd"], 2, stream=None)
    run = subprocess.run([PY, "-m", "pdjax", "launch", "--num-processes", "2", "--", "nosuchcmd"],
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert run.returncode == 1
    assert run.stderr.splitlines() == ["pdjax launch: cannot run 'nosuchcmd': no such executable on PATH"]


@pytest.mark.parametrize("option,value,message", [
    ("--platform", "cpuu", "argument --platform: invalid choice: 'cpuu'"),
    ("--num-processes", "0", "--num-processes must be an integer >= 1, got 0"),
    ("--num-processes", "two", "argument --num-processes: invalid int value: 'two'"),
    ("--devices-per-process", "0", "--devices-per-process must be an integer >= 1, got 0"),
    ("--timeout", "0", "--timeout must be > 0, got 0.0"),
    ("--timeout", "-5", "--timeout must be > 0, got -5.0"),
    ("--timeout", "inf", "--timeout must be finite, got inf"),
    ("--timeout", "nan", "--timeout must be finite, got nan"),
])
def test_a_bad_option_is_named_with_its_value_before_anything_starts(option, value, message, tmp_path, capsys):
    marker = tmp_path / "started"
    argv = ["--num-processes", "2", option, value, "--", PY, "-c", f"open({str(marker)!r}, 'w')"]
    if option == "--num-processes":
        argv = argv[2:]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not marker.exists()


def test_launch_checks_every_argument_before_anything_starts(tmp_path):
    marker = tmp_path / "started"
    argv = [PY, "-c", f"open({str(marker)!r}, 'w')"]
    for kwargs, match in (({"platform": "cpuu"}, r"platform must be one of cpu, gpu, .*got 'cpuu'"),
                          ({"num_processes": 0}, r"num_processes must be an integer >= 1, got 0"),
                          ({"devices_per_process": 0}, r"devices_per_process must be an integer >= 1, got 0"),
                          ({"platform": "gpu", "devices_per_process": 4},
                           r"devices_per_process counts simulated CPU devices .*got 4"),
                          ({"timeout_s": 0}, r"timeout_s must be > 0, got 0"),
                          ({"timeout_s": float("inf")}, r"timeout_s must be finite, got inf"),
                          ({"timeout_s": float("nan")}, r"timeout_s must be finite, got nan")):
        with pytest.raises(ValueError, match=match):
            launch(argv, **{"num_processes": 2, "stream": None, **kwargs})
    assert not marker.exists()


STOPPED = """
import os, signal, time
print("pid", os.getpid(), flush=True)
import pdjax
spec = pdjax.cluster.initialize(heartbeat_timeout_s=3)
print("joined", flush=True)
if spec.process_id == 1:
    os.kill(os.getpid(), signal.SIGSTOP)     # alive, answering nothing: the heartbeat fails
time.sleep(600)
"""


def test_a_stopped_process_is_named_not_the_healthy_one_the_heartbeat_aborts():
    """A real 2-process jax.distributed cluster (heartbeat 3 s): process 1 stops itself
    (SIGSTOP); the coordination service then aborts process 0 (SIGABRT). The launch error
    names process 1, and no process is left (a stopped one dies by SIGKILL too)."""
    stream = io.StringIO()
    with pytest.raises(LaunchError) as e:
        launch([PY, "-c", STOPPED], 2, timeout_s=120, stream=stream)
    message = str(e.value)
    assert e.value.process == 1 and message.startswith("process 1 of 2 was stopped"), message
    assert "then process 0 of 2 " in message and "joined" in e.value.tail
    pids = [int(p) for p in re.findall(r"^\[\d\] pid (\d+)$", stream.getvalue(), re.M)]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pin_cores needs Linux")
def test_pin_cores_pins_each_process_before_its_command_starts(tmp_path, monkeypatch, capsys):
    """``pin_cores``: process i runs on the i-th core given (in turn), set before the command
    starts (its first line already sees it); the variable that carries it does not reach the
    command. A core this process may not use is refused before anything starts."""
    cores = sorted(os.sched_getaffinity(0))
    out = tmp_path / "aff"
    code = ("import os; open(os.environ['OUT'] + os.environ['PDJAX_PROCESS_ID'], 'w').write("
            "repr((sorted(os.sched_getaffinity(0)), os.environ.get('PDJAX_PIN_CORES'))))")
    launch([sys.executable, "-c", code], 3, env={"OUT": str(out)}, pin_cores=[cores[-1], cores[0]], stream=None)
    got = [eval((tmp_path / f"aff{i}").read_text()) for i in range(3)]
    assert got == [([cores[-1]], None), ([cores[0]], None), ([cores[-1]], None)]
    launch([sys.executable, "-c", code], 1, env={"OUT": str(out)}, pin_cores=True, stream=None)
    assert eval((tmp_path / "aff0").read_text()) == ([cores[0]], None)
    for bad in ([max(cores) + 1], [], "0", [-1]):
        with pytest.raises(ValueError, match="pin_cores"):
            launch([sys.executable, "-c", "raise SystemExit(3)"], 1, pin_cores=bad, stream=None)
    monkeypatch.setenv("OUT", str(tmp_path / "cli"))            # pdjax launch --pin-cores: the same
    assert main(["--num-processes", "2", "--pin-cores", "--", sys.executable, "-c", code]) == 0
    assert eval((tmp_path / "cli1").read_text()) == ([cores[1 % len(cores)]], None)
