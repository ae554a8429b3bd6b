"""``pdjax serve``: every option checked before anything starts (in process, through
``pdjax.disagg.serve.main``: a bad one is SystemExit(2) naming the option and its value,
before the params are built); the documented ``pdjax serve --role decode --preset tiny``
starts with its default slots on the 8 devices pdjax gives it; a server whose stdin is at
end of file (started by hand, under nohup, in a container) serves; a start-up that fails
exits with its status and message, not an abort; and the stdin watch
(``exit_when_orphaned``) watches only a supervisor's pipe, ending the process when it
closes."""

import os
import stat
import subprocess
import sys
import threading

import pytest

from pdjax.cluster import supervisor
from pdjax.cluster.supervisor import Supervisor, device_environ
from pdjax.disagg import serve

from child_env import CHILD_ENV

SERVE = [sys.executable, "-m", "pdjax", "serve"]
STARTUP_S = 300                   # a loaded machine: imports, params, pools


@pytest.fixture
def in_process(monkeypatch):
    """serve.main in this process: no stdin watch, and building the params fails the test
    (every check must come before it)."""
    monkeypatch.setattr(serve, "exit_when_orphaned", lambda: None)

    def started(*args, **kwargs):
        raise AssertionError("serve.main went on to build the params")
    monkeypatch.setattr(serve, "init_params", started)


BAD = [
    ("decode", ["--mesh", '{"expert": -4}'], ["--mesh axis 'expert'", "got -4"]),
    ("ffn", ["--mesh", '{"expert": -4}'], ["--mesh axis 'expert'", "got -4"]),
    ("ffn", ["--mesh", '{"exprt": 2}'], ["--mesh", "'exprt'", "ffn"]),
    ("prefill", ["--mesh", '{"data": 2, "model": 2}'], ["--mesh", "'model'"]),
    ("decode", ["--mesh", "[4]"], ["--mesh must be a JSON object", "[4]"]),
    ("decode", ["--mesh", "{}"], ["--mesh must be a JSON object", "{}"]),
    ("decode", ["--mesh", '{"expert": 2.5}'], ["--mesh axis 'expert'", "2.5"]),
    ("decode", ["--mesh", '{"expert": 16}'], ["--mesh", "needs 16 devices", "has 8"]),
    ("decode", ["--mesh", '{"expert": 3}'], ["--mesh", "expert", "8 routed experts"]),
    ("decode", ["--max-context", "0"], ["--max-context", "got 0"]),
    ("decode", ["--max-context", "4096"], ["--max-context", "got 4096"]),
    ("decode", ["--block-size", "-16"], ["--block-size", "got -16"]),
    ("prefill", ["--block-size", "0"], ["--block-size", "got 0"]),
    ("decode", ["--block-size", "abc"], ["--block-size", "'abc'"]),
    ("decode", ["--pull-timeout", "-1"], ["--pull-timeout", "got -1"]),
    ("ffn", ["--pull-timeout", "0"], ["--pull-timeout", "got 0"]),
    ("decode", ["--pull-timeout", "nan"], ["--pull-timeout", "nan"]),
    ("decode", ["--handoff-timeout", "inf"], ["--handoff-timeout", "inf"]),
    ("decode", ["--slots", "0"], ["--slots", "got 0"]),
    ("decode", ["--slots", "6", "--mesh", '{"expert": 4}'], ["--slots", "4 decode ranks", "got 6"]),
    ("decode", ["--num-blocks", "1"], ["--num-blocks", "got 1"]),
    ("decode", ["--max-prefill-attempts", "0"], ["--max-prefill-attempts", "got 0"]),
    ("decode", ["--seed", "-1"], ["--seed", "got -1"]),
    ("decode", ["--seed", str(2**32)], ["--seed", str(2**32)]),
    ("decode", ["--preset", "huge"], ["--preset", "'huge'"]),
    ("prefill", ["--prefix-cache", "-5"], ["--prefix-cache", "got -5"]),
    ("prefill", ["--prefix-cache", "abc"], ["--prefix-cache", "'abc'"]),
    ("prefill", ["--prefix-cache", '{"host_blok": 4}'], ["--prefix-cache", "'host_blok'"]),
    ("prefill", ["--prefix-cache", '{"device_blocks": -1}'], ["--prefix-cache device_blocks", "got -1"]),
    ("prefill", ["--prefix-cache", '{"disk_blocks": 4}'], ["--prefix-cache", "disk_dir"]),
    ("prefill", ["--slots", "8"], ["--slots is an option of the decode role", "not of prefill"]),
    ("ffn", ["--block-size", "16"], ["--block-size is an option of the prefill and decode role"]),
    ("decode", ["--prefix-cache", "16"], ["--prefix-cache is an option of the prefill role"]),
    ("decode", ["--host", "192.0.2.1"], ["--host", "'192.0.2.1'"]),
    ("decode", ["--host", ""], ["--host", "''"]),
]


@pytest.mark.parametrize("role, argv, words", BAD, ids=[f"{r} {' '.join(a)}" for r, a, _ in BAD])
def test_a_bad_option_is_named_before_anything_starts(in_process, capsys, role, argv, words):
    with pytest.raises(SystemExit) as e:
        serve.main(["--role", role, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


def _resolved(argv, devices):
    args = serve.build_parser().parse_args(argv)
    cfg = serve.check_options(args)
    return serve.resolve_mesh(args, cfg, devices), args


def test_the_default_slots_divide_over_the_default_mesh():
    """4 slots rounded up to a multiple of the decode ranks: the documented command's 8
    devices get 8; 4 or fewer devices keep 4; a given count that divides is kept."""
    mesh, args = _resolved(["--role", "decode", "--preset", "tiny"], 8)
    assert mesh == {"expert": 8} and args.slots == 8
    assert (args.block_size, args.max_context, args.pull_timeout) == (16, 1024, 60.0)
    assert _resolved(["--role", "decode"], 4)[1].slots == 4
    assert _resolved(["--role", "decode"], 2)[1].slots == 4
    assert _resolved(["--role", "decode", "--mesh", '{"data": 3}'], 8)[1].slots == 6
    assert _resolved(["--role", "decode", "--slots", "12", "--mesh", '{"data": 2, "expert": 2}'], 8)[1].slots == 12
    mesh, args = _resolved(["--role", "prefill", "--prefix-cache", "0"], 4)
    assert mesh == {"expert": 4} and args.prefix_cache is None
    assert _resolved(["--role", "prefill", "--prefix-cache", "64"], 4)[1].prefix_cache == {"host_blocks": 64}


# ---- the stdin watch ---------------------------------------------------------------------------
class _Recorder:
    started = 0

    def __init__(self, *args, **kwargs):
        pass

    def start(self):
        _Recorder.started += 1


@pytest.mark.parametrize("mode, flag, watches", [
    (stat.S_IFIFO, "1", True),                  # a Supervisor's orphan pipe
    (stat.S_IFIFO, None, False),                # a shell's pipe
    (stat.S_IFIFO, "0", False),
    (stat.S_IFCHR, None, False),                # /dev/null (a Supervisor without orphan_pipe, nohup, ...)
    (stat.S_IFREG, None, False),                # a file
    (stat.S_IFCHR, "1", False),                 # the marker inherited, stdin not a pipe
], ids=["supervisor-pipe", "shell-pipe", "pipe-flag-0", "dev-null", "file", "dev-null-flag-1"])
def test_the_stdin_watch_watches_only_a_supervisors_pipe(monkeypatch, mode, flag, watches):
    _Recorder.started = 0
    with monkeypatch.context() as m:           # os and threading patched for this call only
        m.setattr(os, "fstat", lambda fd: os.stat_result((mode | 0o600,) + (0,) * 9))
        if flag is None:
            m.delenv("PDJAX_ORPHAN_PIPE", raising=False)
        else:
            m.setenv("PDJAX_ORPHAN_PIPE", flag)
        m.setattr(threading, "Thread", _Recorder)
        supervisor.exit_when_orphaned()
        assert "PDJAX_ORPHAN_PIPE" not in os.environ       # not passed on to what this process starts
    assert _Recorder.started == (1 if watches else 0)


def test_a_supervised_child_exits_when_its_supervisor_pipe_closes():
    code = ("from pdjax.cluster.supervisor import announce_ready, exit_when_orphaned\n"
            "import time\nexit_when_orphaned()\nannounce_ready({})\ntime.sleep(600)")
    with Supervisor() as sup:
        i = sup.start([sys.executable, "-c", code], orphan_pipe=True)
        sup.wait_ready(i, 60)
        sup.popen(i).stdin.close()              # the supervisor is gone, as far as the child can tell
        assert sup.popen(i).wait(timeout=60) == 0


# ---- pdjax serve in its own process ------------------------------------------------------------
def _documented_env() -> dict:
    """The environment of a user's shell: no device count (pdjax gives serve 8), no pdjax
    variables, the test suite's compilation cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDJAX_")}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    return {**env, **CHILD_ENV, "PYTHONUNBUFFERED": "1"}


def test_the_documented_decode_command_serves_with_stdin_at_end_of_file():
    """``pdjax serve --role decode --preset tiny`` with stdin at end of file (``< /dev/null``):
    it prints its ready line, accepts a client and stays up until it is killed."""
    import socket

    with Supervisor(tail_lines=400) as sup:     # stdin: /dev/null (no orphan pipe)
        i = sup.start([*SERVE, "--role", "decode", "--preset", "tiny"], _documented_env(), name="decode")
        assert sup.popen(i).stdin is None
        info = sup.wait_ready(i, STARTUP_S)
        assert info["role"] == "decode" and info["pid"] == sup.pid(i)
        host, port = info["control"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=60):
            assert sup.poll() == [None], sup.tail(i)
    assert sup.poll() == [-9]                  # killed by close(), not exited


def test_a_bad_option_exits_with_its_message_not_a_signal():
    p = subprocess.Popen([*SERVE, "--role", "decode", "--block-size", "-16"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_documented_env(), text=True)
    try:
        out, err = p.communicate(timeout=STARTUP_S)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 2, err
    assert "--block-size must be an integer >= 1, got -16" in err and "Fatal Python error" not in err


def test_a_failed_start_under_a_supervisor_exits_with_its_status_not_an_abort():
    """Under a supervisor's orphan pipe (the stdin watch running), a start-up that fails after
    jax has started ends with its own status and message: the watch holds no stdin lock."""
    with Supervisor() as sup:
        i = sup.start([*SERVE, "--role", "decode", "--mesh", '{"expert": 16}'],
                      device_environ(4, CHILD_ENV), name="decode", orphan_pipe=True)
        line = sup.wait_for_line(i, "pdjax serve: error:", STARTUP_S)
        assert sup.popen(i).wait(timeout=STARTUP_S) == 2, sup.tail(i)
        assert "needs 16 devices" in line and "has 4" in line
        assert "Fatal Python error" not in sup.tail(i)
