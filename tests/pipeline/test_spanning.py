"""The pipeline executor with its ranks in two processes of a jax.distributed launch (2
processes x 2 CPU devices, a rank per device; pdjax.cluster.launch): a training step of
``zb1p`` and ``dualpipe`` equals jax.value_and_grad of the unsplit model, activations and
gradients cross the process boundary with the schedule's own sends, the timeline holds on
one clock, and the measured peak bytes per rank are simulate()'s; pipeline.train resumes its
orbax checkpoint with another process count; a rank killed between steps fails the launch
naming its process and ranks, and no process is left."""

import io
import os
import sys

import jax
import numpy as np
import pytest

import pdjax
import pdjax.pipeline as pp
from pdjax.cluster import LaunchError, launch
from pdjax.cluster.children import process_state

import spanning_script as script
import train_script

SCRIPT = os.path.abspath(script.__file__)
TRAIN = os.path.abspath(train_script.__file__)


@pytest.mark.parametrize("name", ["zb1p", "dualpipe"])
def test_step_with_ranks_in_two_processes_equals_value_and_grad(name, tmp_path):
    out = tmp_path / "step.npz"
    launch([sys.executable, SCRIPT, name, str(out)], 2, 2, timeout_s=120, stream=io.StringIO())
    got = np.load(out)
    cfg, params, schedule, tokens = script.setup(name)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(pdjax.loss), static_argnums=1)(params, cfg, tokens)
    assert abs(float(got["loss"]) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert float(got["loss2"]) == float(got["loss"])          # the second step moved the same values
    leaves = jax.tree.leaves(ref_grads)
    for i, ref in enumerate(leaves):
        ref = np.asarray(ref)
        err = np.max(np.abs(got[f"g{i}"] - ref)) / (np.max(np.abs(ref)) + 1e-30)
        assert err <= 1e-5, (i, err)
    assert list(got["local"]) == [0, 1]                       # process 0 ran ranks 0 and 1, process 1 the others
    # activations and gradients between ranks 1 and 2 crossed the processes: every cross-rank
    # dependency held on the shared clock
    assert int(got["deps"]) > 0
    memory = {"F": got["stage_F"], "I": got["stage_I"], "I_free": got["stage_I_free"]}
    np.testing.assert_array_equal(got["memory"], pp.simulate(schedule, memory=memory).peak_memory)
    assert np.all(got["memory"] > 0)


def test_a_rank_killed_between_steps_fails_the_launch_naming_it_and_leaves_no_process(tmp_path):
    """Process 1 (ranks 2 and 3) SIGKILLs itself after a step; process 0's next step waits
    for values that never come. The launch fails naming process 1, its signal and its ranks
    (from the line the executor prints when it takes them), and kills process 0: none is
    left."""
    pids = tmp_path / "pid"
    with pytest.raises(LaunchError) as err:
        launch([sys.executable, SCRIPT, "zb1p", str(pids), "kill"], 2, 2, timeout_s=120, stream=io.StringIO())
    text = str(err.value)
    assert err.value.process == 1 and "process 1 of 2" in text and "SIGKILL" in text, text
    assert "process 1 of 2 runs ranks 2, 3" in text, text
    assert "the step after the kill returned" not in text
    for i in (0, 1):
        assert process_state(int((tmp_path / f"pid.{i}").read_text())) in (None, "Z"), i


def _train_launched(steps, checkpoint_dir, out):
    launch([sys.executable, TRAIN, str(steps), str(checkpoint_dir), str(out)], 2, 2, timeout_s=120,
           stream=io.StringIO())
    return list(np.load(out))


def test_training_resumes_with_another_process_count(tmp_path):
    """pipeline.train with its ranks in 2 processes writes an orbax checkpoint that resumes in
    1 process, and a 1-process checkpoint resumes in 2: both loss curves equal the
    uninterrupted 1-process run's, exactly."""
    half, total = train_script.TOTAL // 2, train_script.TOTAL
    devices = jax.devices()[:train_script.RANKS]
    whole = train_script.run(total, None, devices).losses
    two_then_one = tmp_path / "a"
    first = _train_launched(half, two_then_one, tmp_path / "a.npy")
    assert first == whole[:half]
    assert train_script.run(total, str(two_then_one), devices).losses == whole
    one_then_two = tmp_path / "b"
    assert train_script.run(half, str(one_then_two), devices).losses == whole[:half]
    assert _train_launched(total, one_then_two, tmp_path / "b.npy") == whole


def test_executed_bubbles_cluster_mode_measures_like_the_simulator():
    """measure_schedule(cluster=True) (the executed_bubbles experiment's cluster mode): a rank
    per process of a launch, ops timed under the machine's lock; the measured peaks equal the
    simulated byte model and every op was timed."""
    from pdjax.pipeline.measurement import measure_schedule

    cfg, params, _, _ = script.setup("zb1p")
    row = measure_schedule("zb1p", cfg, num_ranks=2, num_microbatches=4, batch_shape=(4, 8), params=params,
                           repeats=1, op_repeats=1, cluster=True)
    assert row.mode == "cluster"
    assert row.measured_peak_bytes == row.simulated_peak_bytes and min(row.measured_peak_bytes) > 0
    assert row.measured_makespan_ms > 0 and row.simulated_makespan_ms > 0
    assert all(v > 0 for k in ("F", "I", "W") for v in row.costs[k])
