"""pdjax.cluster on local CPU clusters (2 processes x 4 simulated devices, loopback): a mesh
spanning the processes gives the single-process result, and a process that fails at start-up,
raises, is SIGKILLed mid-collective, or outlives the timeout fails the launch naming it, with
no process left behind."""

import io
import os
import re
import sys

import jax
import numpy as np
import pytest

import pdjax
from pdjax.cluster import LaunchError, launch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_script.py")


def _launch(mode, out="", timeout_s=90.0):
    stream = io.StringIO()
    try:
        launch([sys.executable, SCRIPT, mode, str(out)], 2, 4, timeout_s=timeout_s, stream=stream)
        return None, stream.getvalue()
    except LaunchError as e:
        return e, stream.getvalue()


def _pids(output: str) -> list[int]:
    return [int(p) for p in re.findall(r"^\[\d\] pid (\d+)$", output, re.M)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_model_on_meshes_spanning_two_processes_equals_one_process(tmp_path):
    """forward, prefill and 4 greedy decode steps on the (2, 4) and (1, 8) data x expert meshes
    over 2 processes x 4 devices (the data split and the EP all-to-all cross the process
    boundary) equal this process's one-device run, f32, within 1e-5 (the one-process meshes
    equal it too: tests/parallel/test_ep.py)."""
    from cluster_script import serve

    out = tmp_path / "logits.npz"
    err, output = _launch("forward", out)
    assert err is None, err
    got = np.load(out)
    cfg = pdjax.configs.tiny()
    params = pdjax.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16), dtype=np.int32)
    want = {name: np.asarray(logits) for name, logits in serve(pdjax, params, cfg, tokens, None)}
    for mesh in ("2x4", "1x8"):
        for name in want:
            np.testing.assert_allclose(got[f"{mesh} {name}"], want[name], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{mesh} {name}")
    assert len(want) == 6 and len(got.files) == 2 * 6
    assert all(_gone(p) for p in _pids(output))


@pytest.mark.parametrize("mode,process,what", [
    ("startup", None, r"exited with code 3"),
    ("raise", 1, r"exited with code 1"),
    ("sigkill", 1, r"killed by signal SIGKILL"),
])
def test_a_failing_process_fails_the_launch_naming_it(mode, process, what, tmp_path):
    """A process that dies at start-up (either may be first), raises mid-run, or is SIGKILLed
    in the middle of a collective (the other waits in it): the launch fails within its
    timeout, naming the process and what happened, its last lines attached; every process
    of the launch is gone. (At start-up both processes print their pid before exiting: under
    load the first exit used to kill the other before it printed, failing the pid count.)"""
    err, output = _launch(mode, out=tmp_path if mode == "startup" else "", timeout_s=60.0)
    assert isinstance(err, LaunchError) and re.search(what, str(err)), err
    if process is not None:
        assert err.process == process and str(err).startswith(f"process {process} of 2")
    if mode == "raise":
        assert "ValueError: boom in process 1" in err.tail
    pids = _pids(output)
    assert len(pids) == 2 and all(_gone(p) for p in pids)


def test_a_launch_past_its_timeout_is_killed():
    err, output = _launch("hang", timeout_s=8.0)
    assert isinstance(err, LaunchError) and err.process is None
    assert "passed its timeout of 8 s" in str(err) and "[0, 1] still running" in str(err)
    pids = _pids(output)
    assert len(pids) == 2 and all(_gone(p) for p in pids)


def test_cluster_spec_reads_the_launch_environment():
    from pdjax.cluster import cluster_spec

    spec = cluster_spec({"PDJAX_COORDINATOR": "127.0.0.1:1234", "PDJAX_NUM_PROCESSES": "2", "PDJAX_PROCESS_ID": "1"})
    assert (spec.coordinator, spec.num_processes, spec.process_id) == ("127.0.0.1:1234", 2, 1)
    assert cluster_spec({"PDJAX_COORDINATOR": "h:1", "PDJAX_NUM_PROCESSES": "4",
                         "JOB_COMPLETION_INDEX": "3"}).process_id == 3      # a Kubernetes indexed job
    assert cluster_spec({}).coordinator is None                             # jax detects (SLURM, ...)
    for env, match in (({"PDJAX_COORDINATOR": "nohost"}, "host:port"),
                       ({"PDJAX_COORDINATOR": "h:1"}, "must be set too"),
                       ({"PDJAX_COORDINATOR": "h:1", "PDJAX_NUM_PROCESSES": "2", "PDJAX_PROCESS_ID": "2"},
                        "PDJAX_PROCESS_ID"),
                       ({"PDJAX_NUM_PROCESSES": "two"}, "must be an integer")):
        with pytest.raises(ValueError, match=match):
            cluster_spec(env)


def test_pdjax_launch_command_names_the_failing_process(tmp_path):
    """The command line: each process gets its id; process 1 exits 5 once process 0 has
    printed (a file says so: the launch kills the others at the first failure); the launch
    exits 1 naming it (no jax in the children: a second)."""
    import subprocess

    said = tmp_path / "said"
    code = ("import os, sys, time\nme = int(os.environ['PDJAX_PROCESS_ID'])\nprint('id', me, flush=True)\n"
            f"if me == 0:\n    open({str(said)!r}, 'w').close()\n    time.sleep(60)\n"
            f"while not os.path.exists({str(said)!r}):\n    time.sleep(0.01)\nsys.exit(5)")
    run = subprocess.run([sys.executable, "-m", "pdjax", "launch", "--num-processes", "2", "--timeout", "60", "--",
                          sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "process 1 of 2 exited with code 5" in run.stderr
    assert "[0] id 0" in run.stdout and "[1] id 1" in run.stdout
