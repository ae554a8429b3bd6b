"""The input contract of the runtime surfaces, as a property (the model API's is
tests/test_input_contract.py, with the same helpers): the checkpoints (save_params /
restore_params), training (train), the executor's step, the launcher, jax.distributed set-up,
``pdjax serve`` and the engines' arrival times. A bad value is refused with a ValueError or
TypeError that names the argument, before anything starts: no XLA program compiled, nothing
written, no process started, no hang."""

import math
import os

import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st

import pdjax
import pdjax.pipeline as pp
from pdjax.cluster import LaunchError
from tests.test_input_contract import BOOLS, NON_FINITE, NOT_NUMBERS, SETTINGS, bad_count, refused

PATHS = st.sampled_from([None, 3, 1.5, b"/tmp/x", ["a"], object()])


# ---- checkpoints ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_params):
    path = str(tmp_path_factory.mktemp("ckpt") / "params")
    pdjax.save_params(path, tiny_params)
    return path


def _save_calls(tmp, params):
    existing = tmp / "existing"
    existing.mkdir(exist_ok=True)
    return {"path": st.one_of(PATHS, st.sampled_from([str(existing), str(tmp / "no" / "parent" / "x"),
                                                       "/etc/passwd"])),
            "params": st.sampled_from([{"a": object()}, {"a": "text"}, {}, {"a": None}, [None]])}


@SETTINGS
@given(data=st.data())
def test_save_params_refuses_bad_arguments(compile_counter, tmp_path_factory, tiny_params, data):
    tmp = tmp_path_factory.getbasetemp() / "save_contract"
    tmp.mkdir(exist_ok=True)
    bad = _save_calls(tmp, tiny_params)
    arg = data.draw(st.sampled_from(sorted(bad)), label="argument")
    value = data.draw(bad[arg], label="value")
    kwargs = {"path": str(tmp / "fresh"), "params": tiny_params, arg: value}
    before = sorted(os.listdir(tmp))
    refused(compile_counter, lambda: pdjax.save_params(**kwargs), arg)
    assert sorted(os.listdir(tmp)) == before, "a refused save wrote something"


@SETTINGS
@given(data=st.data())
def test_restore_params_refuses_bad_arguments(compile_counter, tmp_path_factory, saved, data):
    empty = tmp_path_factory.getbasetemp() / "empty_dir"
    empty.mkdir(exist_ok=True)
    bad = {"path": st.one_of(PATHS, st.sampled_from([saved + "_missing", "/etc/passwd", str(empty)])),
           "sharding": st.sampled_from(["x", 3, [None], {"a": 1}])}
    arg = data.draw(st.sampled_from(sorted(bad)), label="argument")
    value = data.draw(bad[arg], label="value")
    kwargs = {"path": saved, arg: value}
    refused(compile_counter, lambda: pdjax.restore_params(**kwargs), arg)


# ---- training and the executor's step -------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer(tiny_cfg):
    schedule = pp.build("1f1b", 2, 4)
    return schedule, pp.Executor(schedule, tiny_cfg, jax.devices()[:2], measure=False)


TOKENS_BAD = st.sampled_from([np.zeros((8, 16), np.float32), np.full((8, 16), np.nan), np.full((8, 16), -1),
                              np.full((8, 16), 10 ** 6), np.zeros(16, np.int32), np.zeros((0, 16), np.int32),
                              np.zeros((8, 16), bool), np.zeros((7, 16), np.int32), "tokens", None])


@SETTINGS
@given(data=st.data())
def test_train_refuses_bad_arguments(compile_counter, tmp_path_factory, tiny_cfg, trainer, data):
    schedule, ex = trainer
    tmp = tmp_path_factory.getbasetemp() / "train_contract"
    tmp.mkdir(exist_ok=True)
    a_file = tmp / "a_file"
    a_file.write_text("x")
    bad = {"steps": bad_count(), "seed": st.one_of(bad_count(minimum=0), st.sampled_from([math.nan, "0"])),
           "checkpoint_every": bad_count().filter(lambda v: v is not None),
           "checkpoint_dir": st.sampled_from([3, 1.5, b"/tmp/x", ["a"], str(a_file)]),
           "optimizer": st.sampled_from([None.__class__, "adam", 3, lambda g: g]),
           "data": st.one_of(TOKENS_BAD.map(lambda t: t if not hasattr(t, "ndim") or t.ndim < 2 else t[None]),
                             st.just(np.zeros((1, 8, 16), np.int32)))}   # a callable is checked per batch as it comes
    arg = data.draw(st.sampled_from(sorted(bad)), label="argument")
    value = data.draw(bad[arg], label="value")
    kwargs = {"data": np.zeros((3, 8, 16), np.int32), "steps": 2, "checkpoint_dir": str(tmp / "ck"), arg: value}
    before = sorted(os.listdir(tmp))
    refused(compile_counter, lambda: pp.train(schedule, tiny_cfg, executor=ex, **kwargs), arg, "tokens")
    assert sorted(os.listdir(tmp)) == before, "a refused train wrote a checkpoint"


@SETTINGS
@given(tokens=TOKENS_BAD)
def test_executor_step_refuses_bad_tokens(compile_counter, tiny_params, trainer, tokens):
    _, ex = trainer
    refused(compile_counter, lambda: ex.step(tiny_params, tokens), "tokens", "batch")


# ---- the launcher, jax.distributed set-up, pdjax serve ---------------------------------------------
@pytest.fixture
def nothing_starts(monkeypatch):
    """Starting a process fails the test: every check must come first."""
    from pdjax.cluster import supervisor

    def started(*args, **kwargs):
        raise AssertionError("a process was started before the bad argument was refused")
    monkeypatch.setattr(supervisor.Supervisor, "start", started)


@SETTINGS
@given(data=st.data())
def test_launch_refuses_bad_arguments(compile_counter, nothing_starts, data):
    from pdjax.cluster.launch import launch
    bad = {"num_processes": bad_count(), "devices_per_process": bad_count(),
           "timeout_s": st.one_of(NOT_NUMBERS.filter(lambda v: v is not None), BOOLS, NON_FINITE,
                                  st.floats(max_value=0.0, allow_nan=False)),
           "platform": st.one_of(st.sampled_from(["cpuu", "", "CPU ", None, 3]), st.text(max_size=6).filter(
               lambda t: t not in ("cpu", "gpu", "cuda", "rocm", "tpu"))),
           "argv": st.sampled_from([[], "python", None, [3], ["pdjax-no-such-command-xyz"]])}
    arg = data.draw(st.sampled_from(sorted(bad)), label="argument")
    value = data.draw(bad[arg], label="value")
    kwargs = {"argv": ["true"], "num_processes": 2, "devices_per_process": 1, "timeout_s": 10.0,
              "platform": "cpu", arg: value}
    with compile_counter() as compiles:
        with pytest.raises((ValueError, TypeError, LaunchError)) as err:
            launch(kwargs.pop("argv"), **kwargs)
    text = str(err.value)
    assert arg in text or (arg == "argv" and ("command" in text or "cannot run" in text)), text
    assert compiles.count == 0


@SETTINGS
@given(data=st.data())
def test_initialize_refuses_bad_arguments_and_environments(data):
    from pdjax.cluster import process
    timeouts = st.one_of(NOT_NUMBERS.filter(lambda v: v is not None), BOOLS, st.floats(),
                         st.integers(max_value=0))
    bad = {"heartbeat_timeout_s": timeouts, "shutdown_timeout_s": timeouts, "initialization_timeout_s": timeouts,
           "PDJAX_COORDINATOR": st.sampled_from(["localhost", ":123", "host:", "host:port", "h:12:x"]),
           "PDJAX_NUM_PROCESSES": st.sampled_from(["0", "-2", "two", "1.5", ""]),
           "PDJAX_PROCESS_ID": st.sampled_from(["2", "-1", "x", "0.0"])}
    arg = data.draw(st.sampled_from(sorted(bad)), label="argument")
    value = data.draw(bad[arg], label="value")
    if arg.startswith("PDJAX_"):
        env = {"PDJAX_COORDINATOR": "127.0.0.1:1234", "PDJAX_NUM_PROCESSES": "2", "PDJAX_PROCESS_ID": "1", arg: value}
        with pytest.raises(ValueError, match=arg):
            process.cluster_spec(env)
        return
    with pytest.raises((ValueError, TypeError), match=arg):   # the arguments come first: nothing joins
        process.initialize(**{arg: value})


SERVE_BAD = {"--block-size": st.sampled_from(["0", "-16", "x", "1.5"]), "--max-context": st.sampled_from(["0", "-1", "x"]),
             "--slots": st.sampled_from(["0", "-4", "3", "x"]), "--num-blocks": st.sampled_from(["1", "0", "-1"]),
             "--pull-timeout": st.sampled_from(["-1", "0", "nan", "inf", "x"]),
             "--handoff-timeout": st.sampled_from(["-1", "0", "nan", "inf"]),
             "--max-prefill-attempts": st.sampled_from(["0", "-1", "1.5"]), "--seed": st.sampled_from(["-1", "x", "1e3"]),
             "--mesh": st.sampled_from(['{"expert": -4}', '{"expert": 0}', '{"exprt": 2}', '[2]', '{}', 'x', '{"data": 1.5}']),
             "--preset": st.sampled_from(["huge", "", "TINY"]), "--host": st.sampled_from(["", "192.0.2.1", "no such host"])}


@SETTINGS
@given(data=st.data())
def test_serve_refuses_bad_options_before_anything_starts(monkeypatch, capsys, data):
    from pdjax.disagg import serve
    monkeypatch.setattr(serve, "exit_when_orphaned", lambda: None)

    def started(*args, **kwargs):
        raise AssertionError("serve.main went on to build the params")
    monkeypatch.setattr(serve, "init_params", started)
    option = data.draw(st.sampled_from(sorted(SERVE_BAD)), label="option")
    value = data.draw(SERVE_BAD[option], label="value")
    with pytest.raises(SystemExit) as e:
        serve.main(["--role", "decode", option, value])
    assert e.value.code == 2
    assert option in capsys.readouterr().err
