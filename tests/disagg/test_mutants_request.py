"""Requests on their own (pdjax.disagg.request): sampling parameters' bounds, a request's
defaults and metrics, validate_request's and check_arrivals' boundaries, and the sampler's
distribution. The engine tests reach these only through whole runs, where a metric computed
from the wrong token times, an arrival check one index off, or a sampler that keeps one
token too many is silent (greedy tokens still match)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.arguments import ArgumentTypeError
from pdjax.disagg.clock import Clock
from pdjax.disagg.request import Request, RequestError, SamplingParams, check_arrivals, validate_request
from pdjax.disagg.sampling import sample


def test_sampling_params_defaults_and_bounds():
    """Greedy, top_p 1, seed 0 by default; temperature >= 0 (any positive value, not only
    >= 1; NaN refused); top_p in (0, 1] (both 1 and values below it accepted, 0 and > 1
    refused); frozen (a request's sampling cannot be changed under it)."""
    sp = SamplingParams()
    assert (sp.temperature, sp.top_p, sp.seed) == (0.0, 1.0, 0)
    SamplingParams(temperature=0.5, top_p=0.5)
    SamplingParams(temperature=0.0, top_p=1.0)
    for kw, says in (({"temperature": -0.1}, "temperature must be >= 0"), ({"temperature": float("nan")}, "temperature"),
                     ({"top_p": 0.0}, "top_p must be in"), ({"top_p": 1.5}, "top_p must be in")):
        with pytest.raises(RequestError, match=says):
            SamplingParams(**kw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.seed = 3


def test_a_fresh_request_and_its_metrics():
    """A new request holds nothing yet: every metric is its empty value, the sampling greedy;
    it is done once it has an error or a finish time (either one)."""
    r = Request(4, [1, 2, 3], 6)
    assert r.sampling == SamplingParams() and r.stop_tokens == () and r.retention == "chat" and not r.done
    assert (r.arrival, r.output, r.error, r.first_token_time, r.finish_time) == (0.0, [], None, None, None)
    assert r.metrics() == {"index": 4, "prompt_tokens": 3, "new_tokens": 0, "ttft": None, "tpot": None, "itl": [],
                           "token_times": [], "e2e": None, "kv_bytes_sent": 0, "prefix_hit_tokens": 0,
                           "kv_wait_s": 0.0, "reserve_wait_s": 0.0, "prefill_attempts": 0, "prefix_errors": [],
                           "prefill_worker": None, "predicted_prefill_s": None, "prefill_chunks": [],
                           "handoff_timeouts": 0, "error": None}
    assert Request(0, [1], 1, error=RequestError("bad")).done and Request(0, [1], 1, finish_time=0.0).done


def test_request_metrics_are_computed_from_its_times():
    """ttft and e2e from the arrival; tpot = (last - first token time) / (tokens - 1), None
    for fewer than two tokens; itl the gaps between consecutive tokens; the error as text."""
    r = Request(1, [5, 6], 3, arrival=1.0, first_token_time=1.5, token_times=[1.5, 1.75, 2.25], finish_time=3.0,
                output=[7, 8, 9], error=RequestError("late"))
    m = r.metrics()
    assert (m["ttft"], m["tpot"], m["itl"], m["e2e"], m["new_tokens"]) == (0.5, 0.375, [0.25, 0.5], 2.0, 3)
    assert m["token_times"] == [1.5, 1.75, 2.25] and m["error"] == "late"
    assert Request(0, [1], 2, token_times=[1.0, 1.5]).metrics()["tpot"] == 0.5
    assert Request(0, [1], 2, token_times=[1.0]).metrics()["tpot"] is None


def test_validate_request_boundaries():
    """max_new_tokens: a positive int (numpy ints too; not a bool, a float, 0); the prompt's
    problem named (empty, a token outside the vocabulary); prompt + max_new_tokens may equal
    the context, not exceed it."""
    for mnt in (1, np.int64(2)):
        validate_request(Request(0, [1, 2], mnt), vocab_size=10, max_context=8)
    validate_request(Request(0, [1, 2, 3], 5), vocab_size=10, max_context=8)
    for mnt in (0, -1, True, np.bool_(True), 2.0):
        with pytest.raises(RequestError, match="max_new_tokens must be a positive integer"):
            validate_request(Request(0, [1, 2], mnt), vocab_size=10, max_context=8)
    for prompt, says in (([], r"^request 3: empty prompt$"), ([1, 10], r"^request 3: prompt holds token id 10")):
        with pytest.raises(RequestError, match=says):
            validate_request(Request(3, prompt, 1), vocab_size=10, max_context=8)
    with pytest.raises(RequestError, match=r"prompt \(3\) \+ max_new_tokens \(6\) exceeds the context of 8"):
        validate_request(Request(0, [1, 2, 3], 6), vocab_size=10, max_context=8)


def test_check_arrivals_boundaries():
    """None: every prompt at 0. Lists, tuples and 1-D arrays of one time per prompt, equal
    times allowed; anything else (a range, a 2-D array, a number) refused by type; a decrease
    anywhere (also right after the first time) named with both indices and values."""
    assert check_arrivals(None, 3) == [0.0, 0.0, 0.0] and check_arrivals(None, 0) == []
    assert check_arrivals([0, 1, 1], 3) == [0.0, 1.0, 1.0] and check_arrivals((2, 2.5), 2) == [2.0, 2.5]
    assert check_arrivals(np.array([0.5, 0.5]), 2) == [0.5, 0.5]
    for bad in (range(2), np.zeros((2, 1)), 5, "01"):
        with pytest.raises(ArgumentTypeError, match="arrival_times must be a list of one time"):
            check_arrivals(bad, 2)
    with pytest.raises(ValueError, match="one time per prompt: got 2 times for 3 prompts"):
        check_arrivals([0, 1], 3)
    with pytest.raises(ValueError, match=r"arrival_times\[1\] must be >= 0"):
        check_arrivals([0, -1], 2)
    with pytest.raises(ValueError, match=r"got arrival_times\[1\]=0\.0 after arrival_times\[0\]=1\.0"):
        check_arrivals([1, 0, 2], 3)
    with pytest.raises(ValueError, match=r"got arrival_times\[2\]=0\.5 after arrival_times\[1\]=1\.0"):
        check_arrivals([0, 1, 0.5], 3)


S = 4096
P4 = np.array([0.5, 0.25, 0.125, 0.125], np.float32)     # exact in float32: softmax(log P4) == P4


def _draw(temperature, top_p, logits=np.log(P4), step=0):
    out = sample(jnp.asarray(np.tile(logits, (S, 1)), jnp.float32), jnp.full(S, temperature, jnp.float32),
                 jnp.full(S, top_p, jnp.float32), jnp.arange(S, dtype=jnp.int32), jnp.full(S, step, jnp.int32))
    return np.asarray(out)


def test_sample_follows_the_tempered_top_p_distribution():
    """Over 4096 seeds: temperature 1 draws softmax(logits), temperature 0.5 softmax(2 x
    logits); top_p keeps the smallest set of best tokens whose mass reaches it (0.5: the best
    token alone, its mass exactly 0.5; 0.75: the best two); temperature 0 is the argmax, the
    first of tied maxima (never a random one of them); the draw is keyed by (seed, step)."""
    freq = lambda out: np.bincount(out, minlength=4) / S          # noqa: E731
    np.testing.assert_allclose(freq(_draw(1.0, 1.0)), P4, atol=0.03)
    np.testing.assert_allclose(freq(_draw(0.5, 1.0)), P4 ** 2 / np.sum(P4 ** 2), atol=0.03)
    assert (_draw(1.0, 0.5) == 0).all()
    f = freq(_draw(1.0, 0.75))
    assert f[2:].sum() == 0 and abs(f[0] - 2 / 3) < 0.03
    perm = np.array([2, 0, 3, 1])                                   # the best token not first
    np.testing.assert_allclose(freq(_draw(1.0, 1.0, np.log(P4[perm]))), P4[perm], atol=0.03)
    assert (_draw(1.0, 0.5, np.log(P4[perm])) == 1).all()
    tied = np.log(np.array([0.1, 0.4, 0.4, 0.1], np.float32))
    assert (_draw(0.0, 1.0, tied) == 1).all()
    a, b = _draw(1.0, 1.0, step=0), _draw(1.0, 1.0, step=1)
    assert (a == _draw(1.0, 1.0, step=0)).all() and (a != b).mean() > 0.3
    assert sample(jnp.zeros((1, 4)), jnp.zeros(1), jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32)).dtype \
        == jnp.int32


def test_the_clock_starts_at_zero():
    """An engine's clock reads seconds since it was made."""
    assert 0 <= Clock().now() < 5.0
