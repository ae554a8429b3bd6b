"""Shared by the expert-parallel tests: 16 sequences of 6 tokens and the single-device
model's answers on them (full forward; prefill of 5 tokens; one decode step)."""

import numpy as np
import pytest

import pdjax


@pytest.fixture(scope="session")
def case(tiny_cfg, tiny_params):
    toks = np.random.RandomState(7).randint(0, tiny_cfg.vocab_size, (16, 6)).astype(np.int32)
    full = np.asarray(pdjax.forward(tiny_params, tiny_cfg, toks))
    pre, cache = pdjax.prefill(tiny_params, tiny_cfg, toks[:, :5], max_len=8)
    step, _ = pdjax.decode_step(tiny_params, tiny_cfg, toks[:, 5], cache)
    return toks, full, np.asarray(pre), np.asarray(step)
