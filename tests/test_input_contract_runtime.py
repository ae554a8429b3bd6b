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
