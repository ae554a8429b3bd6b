"""The one process supervisor (pdjax.cluster.supervisor) with plain Python children (no jax:
each test takes about a second): per-process argv and environment, readiness from a line,
a death named with its signal and last lines, kill and restart, and close() leaving no
process behind (a grandchild in the group included), checked in the process table."""

import io
import os
import sys
import time

import pytest

from pdjax.cluster.supervisor import LaunchError, Supervisor, announce_ready

PY = sys.executable


def _alive(pid: int) -> bool:
    """In the process table and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _child(code: str) -> list:
    return [PY, "-c", "import os, sys, time, json\n" + code]


def test_per_process_argv_env_ready_lines_and_streamed_output():
    out = io.StringIO()
    ready = "from pdjax.cluster.supervisor import announce_ready; announce_ready({'who': os.environ['WHO']})"
    with Supervisor(stream=out) as sup:
        a = sup.start(_child(f"print('hello a', flush=True); {ready}; time.sleep(600)"),
                      {**os.environ, "WHO": "a"}, name="alpha")
        b = sup.start(_child(f"print('x' * 3, flush=True); {ready}; time.sleep(600)"),
                      {**os.environ, "WHO": "b"}, name="beta", prefix="[beta]")
        assert sup.wait_ready(a, 30) == {"who": "a"} and sup.wait_ready(b, 30) == {"who": "b"}
        sup.check()                                       # both running: nothing raised
        assert sup.poll() == [None, None] and sup.exited() == []
        pids = [sup.pid(a), sup.pid(b)]
    assert "[0] hello a" in out.getvalue() and "[beta] xxx" in out.getvalue()
    assert not any(_alive(p) for p in pids)


def test_a_death_is_named_with_its_signal_and_last_lines_and_restart_starts_it_again():
    with Supervisor() as sup:
        i = sup.start(_child("print('line one'); print('PDJAX_READY {}', flush=True); time.sleep(600)"),
                      name="decode 1")
        sup.wait_ready(i, 30)
        old = sup.pid(i)
        sup.kill(i)
        with pytest.raises(LaunchError, match=r"^decode 1 was killed by signal SIGKILL") as e:
            sup.check()
        assert e.value.process == i and e.value.returncode == -9 and "line one" in e.value.tail
        new = sup.restart(i)
        assert new != old and not _alive(old) and sup.restarts[i] == 1
        sup.wait_ready(i, 30)
        sup.check()
    assert not _alive(new)


def test_readiness_fails_fast_when_the_process_dies_or_takes_too_long():
    with Supervisor() as sup:
        dead = sup.start(_child("print('bad config', flush=True); sys.exit(3)"), name="prefill")
        slow = sup.start(_child("time.sleep(600)"), name="slow")
        with pytest.raises(LaunchError, match=r"prefill exited with code 3 before printing PDJAX_READY") as e:
            sup.wait_ready(dead, 30)
        assert "bad config" in e.value.tail and e.value.returncode == 3
        t0 = time.monotonic()
        with pytest.raises(LaunchError, match=r"slow did not print PDJAX_READY within 0.5 s"):
            sup.wait_ready(slow, 0.5)
        assert time.monotonic() - t0 < 5
        with pytest.raises(LaunchError, match="was not ready within"):
            sup.wait_until(slow, lambda: None, 0.3)
        with pytest.raises(LaunchError, match="prefill exited with code 3"):
            sup.check()


def test_close_kills_every_group_grandchildren_included():
    """Each process is a group of its own: close() SIGKILLs the group, so a grandchild the
    process started (and a child that ignores SIGTERM) goes too."""
    grandchild = ("import subprocess, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                  "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
                  "print('PDJAX_READY', json.dumps({'child': p.pid}), flush=True); time.sleep(600)")
    sup = Supervisor()
    i = sup.start(_child(grandchild), orphan_pipe=True)
    j = sup.start(_child("time.sleep(600)"))
    child = sup.wait_ready(i, 30)["child"]
    pids = [sup.pid(i), sup.pid(j), child]
    assert all(_alive(p) for p in pids)
    sup.close()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)                # the grandchild is reaped by init, not by us
    assert not any(_alive(p) for p in pids)
    assert [c is not None for c in sup.poll()] == [True, True]


def test_announce_ready_prints_one_json_line(capsys):
    announce_ready({"control": "127.0.0.1:1"})
    assert capsys.readouterr().out == 'PDJAX_READY {"control": "127.0.0.1:1"}\n'
