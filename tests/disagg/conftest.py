"""Shared by the PD engine tests: prompts of 1 to 200 tokens (two share a 40-token prefix)
and what pdjax.generate makes of them (5 greedy tokens each)."""

import numpy as np
import pytest

import pdjax


def _prompts(cfg):
    rng = np.random.RandomState(0)
    system = list(rng.randint(0, cfg.vocab_size, 40))           # a shared prefix
    lens = [1, 7, 200, 33, 2, 90]
    out = [list(rng.randint(0, cfg.vocab_size, n)) for n in lens]
    out += [system + list(rng.randint(0, cfg.vocab_size, n)) for n in (5, 21)]
    return out


@pytest.fixture(scope="session")
def pd_prompts(tiny_cfg):
    return _prompts(tiny_cfg)


@pytest.fixture(scope="session")
def pd_expected(tiny_cfg, tiny_params, pd_prompts):
    out = pdjax.generate(tiny_params, tiny_cfg, pd_prompts, max_new_tokens=5)
    return out
