"""The stage links of a pipeline step (pdjax.pipeline.links), alone: a value offered and
announced is what the consumer takes, once; a consumer's wait has a deadline and ends when
another rank fails; across processes the descriptor goes through the key-value store under a
name of the step and the key, is deleted by its reader, and the pull gets the receiver, the
layout the value is pulled in and what is left of the deadline. (The executor's tests run
both links for real: tests/pipeline/test_executor.py, test_spanning.py.)"""

import json
import threading
import time

import jax
import numpy as np
import pytest

from pdjax.pipeline import links


def test_local_link_hands_the_announced_value_over_once():
    link = links.LocalLink(timeout_s=5.0)
    dev = jax.devices()[1]
    handle = link.offer(("act", 1, 0), np.arange(4.0), jax.sharding.SingleDeviceSharding(dev))
    assert handle[0] == ("act", 1, 0) and handle[1].devices() == {dev}      # placed during the op
    got = []
    waiter = threading.Thread(target=lambda: got.append(link.expect(("act", 1, 0))))
    waiter.start()
    time.sleep(0.05)
    assert not got                                       # not before the announcement
    link.announce(handle)
    waiter.join(5)
    np.testing.assert_array_equal(got[0], np.arange(4.0))
    link.timeout_s = 0.2
    with pytest.raises(TimeoutError, match=r"no value for \('act', 1, 0\) after 0 s"):
        link.expect(("act", 1, 0))                       # taken: it is not there twice


def test_local_link_waits_end_when_a_rank_fails():
    link = links.LocalLink(timeout_s=60.0)
    errors = []

    def wait():
        try:
            link.expect(("grad", 0, 3))
        except links.Aborted:
            errors.append("aborted")
    waiter = threading.Thread(target=wait)
    waiter.start()
    link.fail()
    waiter.join(5)
    assert errors == ["aborted"] and not waiter.is_alive()
    with pytest.raises(links.Aborted):
        links.LocalLink(60.0).expect(("grad", 0, 3), failed=lambda: True)


class _Store:
    """The cluster key-value store's calls, in memory (get waits up to its timeout)."""

    def __init__(self):
        self.data, self.deleted, self.timeouts = {}, [], []

    def put(self, key, value):
        self.data[key] = value

    def get(self, key, timeout_s):
        self.timeouts.append(timeout_s)
        if key not in self.data:
            time.sleep(timeout_s)
            raise TimeoutError(key)
        return self.data[key]

    def delete(self, key):
        self.deleted.append(key)
        self.data.pop(key, None)


class _Sender:
    def __init__(self):
        self.offered = []

    def offer(self, value, gather):
        assert gather is False                           # offered as it lies: the consumer's split
        self.offered.append(value)
        return {"uuid": 7, "shape": list(value.shape), "dtype": str(value.dtype), "nbytes": value.nbytes,
                "layout": "L"}


class _Receiver:
    def __init__(self):
        self.calls = []

    def pull(self, desc, target, timeout_s):
        self.calls.append((desc["uuid"], target, timeout_s))
        return jax.device_put(np.ones(desc["shape"], desc["dtype"]), target)


def test_process_link_goes_through_the_store_and_pulls_with_a_deadline(monkeypatch):
    fake = _Store()
    monkeypatch.setattr(links, "store", fake)
    d0, d1 = (jax.sharding.SingleDeviceSharding(d) for d in jax.devices()[:2])
    receiver, sender = _Receiver(), _Sender()
    key = ("act", 2, 1)
    link = links.ProcessLink(sender, {1: receiver}, "pdjax/pipeline/9/4/values", {key: (1, d0, d1)},
                             lambda k, ndim: d0, timeout_s=30.0)
    handle = link.offer(key, jax.device_put(np.zeros((2, 3), np.float32), d1))
    # offered during the op, on the producer's side, in the split it offers; announced later
    assert [v.sharding for v in sender.offered] == [d0] and not fake.data
    link.announce(handle)
    slot = "pdjax/pipeline/9/4/values/act/2/1"
    assert json.loads(fake.data[slot])["uuid"] == 7
    value = link.expect(key)
    assert value.sharding == d1 and value.shape == (2, 3)    # pulled as offered, then moved to the op's
    assert fake.deleted == [slot] and slot not in fake.data
    (uuid, target, left), = receiver.calls
    assert uuid == 7 and target == d0 and 25.0 < left <= 30.0
    assert all(t <= links.POLL_S for t in fake.timeouts)


def test_process_link_gives_up_at_its_deadline_or_when_a_rank_fails(monkeypatch):
    monkeypatch.setattr(links, "store", _Store())
    d0 = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    key = ("grad", 0, 5)
    link = links.ProcessLink(_Sender(), {1: _Receiver()}, "s", {key: (1, d0, d0)}, lambda k, n: d0, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no value for \('grad', 0, 5\) from process 1 after 0 s"):
        link.expect(key)
    assert 0.3 <= time.monotonic() - t0 < 0.3 + 2 * links.POLL_S
    link.timeout_s = 60.0
    t0 = time.monotonic()
    with pytest.raises(links.Aborted):
        link.expect(key, failed=lambda: True)
    assert time.monotonic() - t0 < 2 * links.POLL_S
