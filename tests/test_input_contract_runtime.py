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
from tests.test_input_contract import SETTINGS, bad_count, refused

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
    refused(compile_counter, lambda: pp.train(tiny_cfg, schedule, executor=ex, **kwargs), arg, "tokens")
    assert sorted(os.listdir(tmp)) == before, "a refused train wrote a checkpoint"


@SETTINGS
@given(tokens=TOKENS_BAD)
def test_executor_step_refuses_bad_tokens(compile_counter, tiny_params, trainer, tokens):
    _, ex = trainer
    refused(compile_counter, lambda: ex.step(tiny_params, tokens), "tokens", "batch")
