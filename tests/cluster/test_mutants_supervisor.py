"""Edges of the process supervisor (pdjax.cluster.children, pdjax.cluster.supervisor) that its
own tests did not pin (found by mutation testing, docs/mutation.md): where a command is
looked up, the orphan pipe a child is told about, and the log file. Plain Python children
(no jax); each test waits on a condition with a deadline and kills what it started."""

import os
import sys

import pytest

from pdjax.cluster.children import ORPHAN_PIPE_ENV, resolve_executable
from pdjax.cluster.supervisor import Supervisor

PY = sys.executable


def test_a_command_is_looked_up_on_the_given_environments_path(tmp_path):
    """resolve_executable searches ``env``'s PATH (what the child will have), not this
    process's; a path with a ``/`` is taken as it is, if it exists and is executable."""
    tool = tmp_path / "pdjax-test-tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert resolve_executable(tool.name, {"PATH": str(tmp_path)}) == str(tool)
    with pytest.raises(FileNotFoundError):
        resolve_executable(tool.name, {"PATH": "/nonexistent"})
    assert resolve_executable(str(tool)) == str(tool)
    with pytest.raises(PermissionError):
        resolve_executable(str(tmp_path))                         # a directory
    with pytest.raises(FileNotFoundError):
        resolve_executable(str(tmp_path / "missing"))


WATCHER = ("import os, sys, time\n"
           "from pdjax.cluster.supervisor import announce_ready, exit_when_orphaned\n"
           "announce_ready({'pipe': os.environ.get('%s'), 'who': os.environ.get('WHO')})\n"
           "exit_when_orphaned()\n"
           "print('after', os.environ.get('%s'), flush=True)\n"
           "time.sleep(600)\n" % (ORPHAN_PIPE_ENV, ORPHAN_PIPE_ENV))


@pytest.mark.parametrize("env", [None, {"WHO": "given"}])
def test_an_orphan_pipe_child_is_told_and_exits_when_the_pipe_closes(env):
    """With ``orphan_pipe=True`` the child's environment (the given one, or this process's)
    carries PDJAX_ORPHAN_PIPE=1, exit_when_orphaned removes it and watches stdin, and the
    child exits 0 once the supervisor's end of the pipe closes."""
    if env is not None:
        env = {**os.environ, **env}
    with Supervisor() as sup:
        i = sup.start([PY, "-c", WATCHER], env, orphan_pipe=True)
        assert sup.wait_ready(i, 120) == {"pipe": "1", "who": None if env is None else "given"}
        sup.wait_for_line(i, "after", 60)
        assert sup.tail(i).splitlines()[-1] == "after None"
        sup.popen(i).stdin.close()
        assert sup.popen(i).wait(timeout=60) == 0


def test_without_an_orphan_pipe_the_child_is_not_told():
    """Without ``orphan_pipe`` the child's stdin is /dev/null and the variable is absent (a
    child that watched /dev/null would exit at once)."""
    with Supervisor() as sup:
        i = sup.start([PY, "-c", WATCHER], {**os.environ, ORPHAN_PIPE_ENV: "0"})
        assert sup.wait_ready(i, 120)["pipe"] == "0"
        sup.wait_for_line(i, "after", 60)
        assert sup.poll() == [None] and sup.popen(i).stdin is None


def test_output_lines_reach_the_tail_the_stream_and_the_log_whole(tmp_path):
    """Each output line, only its newline cut (a line ending in X or spaces keeps them), is
    in the tail, streamed with the process's prefix and appended to its log file."""
    import io

    out, log = io.StringIO(), tmp_path / "child.log"
    log.write_text("earlier\n")
    with Supervisor(stream=out) as sup:
        i = sup.start([PY, "-c", "print('ends in XX'); print('trailing  ', flush=True)"], prefix="[p]",
                      log_path=str(log))
        assert sup.popen(i).wait(timeout=60) == 0
        sup.wait_for_line(i, "trailing", 60)
        assert sup.tail(i) == "ends in XX\ntrailing  "
    assert out.getvalue() == "[p] ends in XX\n[p] trailing  \n"
    assert log.read_text() == "earlier\nends in XX\ntrailing  \n"


def test_a_string_argv_is_refused_before_anything_starts():
    """``launch`` and ``Supervisor.start`` take a list: a command line as one string (or an
    empty list) is a ValueError, not a lookup of its first character."""
    from pdjax.cluster import launch

    for argv in ("python -c pass", []):
        with pytest.raises(ValueError, match="argv must be a non-empty list of strings"):
            launch(argv, 1)
        with Supervisor() as sup:
            with pytest.raises(ValueError, match="argv must be a non-empty list of strings"):
                sup.start(argv)
            assert len(sup) == 0


def test_jax_settings_reach_the_child_environment():
    """jax_settings_environ: each of JAX_SETTINGS that is set here, as its upper-case
    variable with the value's text; unset ones absent."""
    import jax

    from pdjax.cluster.supervisor import JAX_SETTINGS, jax_settings_environ

    old = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        env = jax_settings_environ()
    finally:
        jax.config.update("jax_default_matmul_precision", old)
    assert env["JAX_DEFAULT_MATMUL_PRECISION"] == "highest"
    for name in JAX_SETTINGS:
        value = getattr(jax.config, name, None)
        if name != "jax_default_matmul_precision":
            assert env.get(name.upper()) == (None if value is None else str(value))


def test_device_environ_replaces_only_the_device_count_flag(monkeypatch):
    """On CPU the child's XLA_FLAGS are this process's with the simulated device count
    replaced (not duplicated), every other flag kept; unbuffered output; the running pdjax's
    checkout first on PYTHONPATH."""
    from pdjax.cluster.supervisor import device_environ

    monkeypatch.setenv("XLA_FLAGS", "--xla_a=1 --xla_force_host_platform_device_count=8 --xla_b=2")
    env = device_environ(3, {"EXTRA": "x"})
    assert env["XLA_FLAGS"] == "--xla_a=1 --xla_b=2 --xla_force_host_platform_device_count=3"
    assert env["JAX_PLATFORMS"] == "cpu" and env["PYTHONUNBUFFERED"] == "1" and env["EXTRA"] == "x"
    import pdjax

    root = os.path.dirname(os.path.dirname(os.path.abspath(pdjax.__file__)))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert device_environ(1)["PYTHONPATH"] == os.pathsep.join([root, "/elsewhere"])   # this pdjax first


def test_a_failed_launch_keeps_the_last_20_lines_by_default():
    """launch's default tail: the LaunchError of a process that printed 30 lines and failed
    carries its last 20."""
    from pdjax.cluster import LaunchError, launch

    with pytest.raises(LaunchError) as e:
        launch([PY, "-c", "for i in range(30): print(i)\nraise SystemExit(3)"], 1, stream=None, timeout_s=120)
    assert e.value.returncode == 3 and e.value.tail.splitlines() == [str(i) for i in range(10, 30)]


def test_wait_all_returns_on_clean_exits_and_raises_on_exit_1():
    """wait_all: processes that all exit 0 return their codes; one exiting 1 is a LaunchError
    naming it (exit 0 is fine only with ``exit_ok``: check() alone raises for it)."""
    from pdjax.cluster import LaunchError

    with Supervisor() as sup:
        for _ in range(2):
            sup.start([PY, "-c", "pass"])
        assert sup.wait_all(timeout_s=120) == [0, 0]
        with pytest.raises(LaunchError, match="process 0 exited with code 0"):
            sup.check()
    with Supervisor() as sup:
        sup.start([PY, "-c", "raise SystemExit(1)"], name="one")
        with pytest.raises(LaunchError, match="one exited with code 1"):
            sup.wait_all(timeout_s=120)
