"""The one process supervisor (pdjax.cluster.supervisor) with plain Python children (no jax:
each test takes about a second): per-process argv and environment, readiness from a line,
a death named with its signal and last lines, kill and restart, and close() leaving no
process behind (a grandchild in the group included; children that never exit on their own,
so that only a kill ends them), checked in the process table; a stopped process blamed for
the peer that then aborts; a command that cannot be started."""

import io
import os
import sys
import time

import pytest

from pdjax.cluster.children import process_state
from pdjax.cluster.supervisor import LaunchError, Supervisor, announce_ready

PY = sys.executable


def _alive(pid: int) -> bool:
    """In the process table and not a zombie."""
    return process_state(pid) not in (None, "Z")


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


PAUSE = "import signal; print('PDJAX_READY {}', flush=True); signal.pause()"   # never exits on its own
BOUND_S = 20.0          # close() after SIGKILL takes well under a second; a close that only waits takes 30 s


def test_close_kills_children_that_never_exit_on_their_own():
    sup = Supervisor()
    for _ in range(2):
        sup.start(_child(PAUSE))
    try:
        for i in range(2):
            sup.wait_ready(i, 60)
        pids = [sup.pid(0), sup.pid(1)]
        t0 = time.monotonic()
        sup.close()
        assert time.monotonic() - t0 < BOUND_S
        assert not any(_alive(p) for p in pids)
        assert sup.poll() == [-9, -9]
    finally:
        sup.kill_all()


def test_a_failing_launch_ends_within_a_bound_and_kills_its_sibling_that_never_exits(tmp_path):
    """Process 0 never exits on its own; process 1 exits 3 once process 0 is running: the
    launch raises naming process 1, soon, and process 0 is gone."""
    from pdjax.cluster import launch

    code = (f"import os, signal, sys, time\nd = {str(tmp_path)!r}\n"
            "if os.environ['PDJAX_PROCESS_ID'] == '0':\n"
            "    open(os.path.join(d, 'pid0.tmp'), 'w').write(str(os.getpid()))\n"
            "    os.rename(os.path.join(d, 'pid0.tmp'), os.path.join(d, 'pid0'))\n"
            "    signal.pause()\n"
            "deadline = time.monotonic() + 60\n"
            "while not os.path.exists(os.path.join(d, 'pid0')) and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)\n"
            "sys.exit(3)\n")
    try:
        with pytest.raises(LaunchError, match=r"^process 1 of 2 exited with code 3"):
            launch([PY, "-c", code], 2, stream=None)
        assert time.time() - os.stat(tmp_path / "pid0").st_mtime < BOUND_S   # since process 0 was running
        assert not _alive(int((tmp_path / "pid0").read_text()))
    finally:
        if (tmp_path / "pid0").exists() and _alive(pid := int((tmp_path / "pid0").read_text())):
            os.kill(pid, 9)


def test_a_stopped_process_is_blamed_when_a_peer_then_dies():
    """What a cluster's heartbeat does: a process stops (SIGSTOP), and the healthy peer then
    aborts (SIGABRT). wait_all names the stopped process, not the aborted one."""
    stop = "import signal; print('stopping', flush=True); os.kill(os.getpid(), signal.SIGSTOP)"
    abort = ("import resource, signal; resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
             "stat = lambda: open(f'/proc/{os.environ[\"PEER\"]}/stat').read().rsplit(')', 1)[1].split()[0]\n"
             "deadline = time.monotonic() + 60\n"
             "while stat() != 'T' and time.monotonic() < deadline: time.sleep(0.01)\n"
             "print('peer stopped, aborting', flush=True); os.kill(os.getpid(), signal.SIGABRT)")
    with Supervisor() as sup:
        a = sup.start(_child(stop), name="rank a")
        b = sup.start(_child(abort), {**os.environ, "PEER": str(sup.pid(a))}, name="rank b")
        pids = [sup.pid(a), sup.pid(b)]
        with pytest.raises(LaunchError) as e:
            sup.wait_all(120)
    assert e.value.process == a and e.value.returncode is None and "stopping" in e.value.tail
    assert str(e.value).startswith("rank a was stopped (SIGSTOP, SIGTSTP or a debugger)")
    assert "then rank b was killed by signal SIGABRT" in str(e.value)
    assert not any(_alive(p) for p in pids)


@pytest.mark.parametrize("die_with_parent", [False, True])
def test_a_command_that_cannot_be_started_is_a_launch_error_naming_it(die_with_parent, tmp_path):
    with Supervisor() as sup:
        with pytest.raises(LaunchError, match=r"^rank 0 could not be started: 'nosuchcmd': No such file"):
            sup.start(["nosuchcmd"], name="rank 0", die_with_parent=die_with_parent)
        not_executable = tmp_path / "script"
        not_executable.write_text("#!/bin/sh\n")
        with pytest.raises(LaunchError, match=r"could not be started: '.*script': Permission denied"):
            sup.start([str(not_executable)], die_with_parent=die_with_parent)
        assert len(sup) == 0


def test_close_returns_when_a_process_outside_its_group_holds_its_output_open():
    """A grandchild in a session of its own outlives the group's SIGKILL and keeps the output
    pipe open: close() still returns (the reading thread is left to it), within a bound."""
    escape = ("import subprocess, signal\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'], start_new_session=True)\n"
              "print('PDJAX_READY', json.dumps({'child': p.pid}), flush=True); signal.pause()")
    sup = Supervisor()
    i = sup.start(_child(escape))
    grandchild = None
    try:
        grandchild = sup.wait_ready(i, 60)["child"]
        t0 = time.monotonic()
        sup.close()
        assert time.monotonic() - t0 < BOUND_S
        assert not _alive(sup.pid(i)) and _alive(grandchild)
    finally:
        sup.kill_all()
        if grandchild is not None:
            os.kill(grandchild, 9)
