"""``pdjax.cluster.initialize``: it passes its heartbeat, shutdown and initialization
timeouts to ``jax.distributed.initialize`` (in process, jax's call replaced); and where jax
would crash, abort or speak only of itself, it reports: a coordinator port already taken
(process 0), a cluster that does not form within the initialization timeout (a process
count larger than the processes started), no cluster in the environment. Those run in a
child process each (jax's failures end a process), with generous deadlines."""

import inspect
import os
import socket
import subprocess
import sys
import time

import jax
import pytest

from pdjax.cluster import process
from pdjax.cluster.supervisor import free_port

PDJAX_VARS = ("PDJAX_COORDINATOR", "PDJAX_NUM_PROCESSES", "PDJAX_PROCESS_ID", "PDJAX_INITIALIZATION_TIMEOUT",
              "JOB_COMPLETION_INDEX")
CHILD = "import pdjax.cluster\npdjax.cluster.initialize()\nprint('joined', flush=True)"
DEADLINE_S = 240                 # a loaded machine: the child imports jax


@pytest.fixture
def fake_jax(monkeypatch):
    """jax.distributed.initialize replaced by a recorder; what initialize changes in this
    process (the excepthook, the preemption setting) restored afterwards."""
    calls = []
    real = inspect.signature(jax.distributed.initialize).parameters
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    for name in PDJAX_VARS:
        monkeypatch.delenv(name, raising=False)
    preemption = jax.config.jax_enable_preemption_service
    yield calls, real
    jax.config.update("jax_enable_preemption_service", preemption)


def _cluster(monkeypatch, num: int, pid: int) -> str:
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("PDJAX_COORDINATOR", address)
    monkeypatch.setenv("PDJAX_NUM_PROCESSES", str(num))
    monkeypatch.setenv("PDJAX_PROCESS_ID", str(pid))
    return address


def test_the_timeouts_reach_jax(fake_jax, monkeypatch):
    calls, real = fake_jax
    address = _cluster(monkeypatch, 1, 0)
    spec = process.initialize(heartbeat_timeout_s=7, shutdown_timeout_s=13, initialization_timeout_s=30)
    (args, kwargs), = calls
    assert args == (address, 1, 0) and spec.coordinator == address
    assert set(kwargs) <= set(real)                  # the names the installed jax takes
    assert kwargs["heartbeat_timeout_seconds"] == 7 and kwargs["shutdown_timeout_seconds"] == 13
    # jax's own deadline comes a little after ours (it aborts; ours reports and exits)
    assert 30 < kwargs["initialization_timeout"] <= 30 + process.JAX_GRACE_S
    monkeypatch.setenv("PDJAX_INITIALIZATION_TIMEOUT", "45")
    process.initialize()
    kwargs = calls[-1][1]
    assert 45 < kwargs["initialization_timeout"] <= 45 + process.JAX_GRACE_S
    assert kwargs["heartbeat_timeout_seconds"] == 10 and kwargs["shutdown_timeout_seconds"] == 10


@pytest.mark.parametrize("kwargs, env, words", [
    ({"heartbeat_timeout_s": 0}, None, ["heartbeat_timeout_s", "got 0"]),
    ({"shutdown_timeout_s": 2.5}, None, ["shutdown_timeout_s", "got 2.5"]),
    ({"initialization_timeout_s": -1}, None, ["initialization_timeout_s", "got -1"]),
    ({}, "soon", ["PDJAX_INITIALIZATION_TIMEOUT", "'soon'"]),
    ({}, "0", ["PDJAX_INITIALIZATION_TIMEOUT", "got 0"]),
])
def test_bad_timeouts_are_named_before_jax_is_called(fake_jax, monkeypatch, kwargs, env, words):
    calls, _ = fake_jax
    _cluster(monkeypatch, 2, 1)
    if env is not None:
        monkeypatch.setenv("PDJAX_INITIALIZATION_TIMEOUT", env)
    with pytest.raises(ValueError) as e:
        process.initialize(**kwargs)
    assert all(w in str(e.value) for w in words), e.value
    assert calls == []


def test_no_cluster_names_what_to_set(fake_jax, monkeypatch):
    def undetected(*args, **kwargs):             # what jax says when it detects no cluster
        raise ValueError("coordinator_address should be defined.")
    monkeypatch.setattr(jax.distributed, "initialize", undetected)
    with pytest.raises(ValueError) as e:
        process.initialize()
    for word in ("PDJAX_COORDINATOR", "PDJAX_NUM_PROCESSES", "PDJAX_PROCESS_ID", "pdjax launch",
                 "coordinator_address should be defined"):
        assert word in str(e.value)


# ---- in a child process --------------------------------------------------------------------
def _run(env: dict) -> tuple[int, str, float]:
    """Run CHILD with ``env`` over this environment (no PDJAX variables, CPU): its exit status,
    its output and how long it took; SIGKILLed if it outlives the deadline."""
    base = {k: v for k, v in os.environ.items() if k not in PDJAX_VARS}
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", CHILD], env={**base, "JAX_PLATFORMS": "cpu", **env},
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=DEADLINE_S)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out, time.monotonic() - t0


def test_a_taken_coordinator_port_is_an_error_not_a_crash():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        code, out, _ = _run({"PDJAX_COORDINATOR": address, "PDJAX_NUM_PROCESSES": "1", "PDJAX_PROCESS_ID": "0"})
    assert code == 1, out                            # not a signal (jax segfaults on it)
    assert f"PDJAX_COORDINATOR={address}" in out and "cannot bind" in out and "joined" not in out


def test_a_cluster_that_does_not_form_ends_at_the_initialization_timeout():
    """One process of a claimed two: it gives up after PDJAX_INITIALIZATION_TIMEOUT (3 s, not
    the 120 s default) with a message naming what to check, status 1, not jax's abort."""
    address = f"127.0.0.1:{free_port()}"
    code, out, took = _run({"PDJAX_COORDINATOR": address, "PDJAX_NUM_PROCESSES": "2", "PDJAX_PROCESS_ID": "0",
                            "PDJAX_INITIALIZATION_TIMEOUT": "3"})
    assert code == 1, out
    assert "did not form within 3 s" in out and "process 0 of 2" in out and address in out, out
    assert "PDJAX_NUM_PROCESSES" in out and "pdjax launch" in out and "Check failure" not in out
    assert took < 100, took                          # the 3 s deadline, not the 120 s default


def test_no_cluster_in_a_child_names_what_to_set():
    code, out, _ = _run({})
    assert code == 1, out
    assert "PDJAX_COORDINATOR" in out and "pdjax launch" in out and "joined" not in out
