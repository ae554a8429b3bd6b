"""The receiver's checks on jax.experimental.transfer (pdjax.cluster.transfer), sender and
receiver in this one process on different devices: the descriptor carries the sender's
layout; a pull whose target sharding lays the array out otherwise is refused before
anything is pulled (jax would hand back wrong data silently); a pull past its deadline raises
TimeoutError naming its uuid; a matching sharded pull moves exact values."""

import datetime
import time

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from pdjax.cluster.transfer import ArrayReceiver, ArraySender, layout, start_transfer_server


def _mesh(devices, name="x"):
    return jax.make_mesh((len(devices),), (name,), devices=devices, axis_types=(AxisType.Auto,))


@pytest.fixture(scope="module")
def ends():
    sender = ArraySender(start_transfer_server(jax.devices()[:4]))
    receiver = ArrayReceiver(sender.address, start_transfer_server(jax.devices()[4:]), timeout_s=30)
    return sender, receiver


def _rows(sharding, shape=(8, 40)):
    return jax.device_put(np.arange(np.prod(shape), dtype=np.float32).reshape(shape), sharding)


def test_descriptor_carries_the_senders_layout(ends):
    sender, _ = ends
    rows = _rows(NamedSharding(_mesh(jax.devices()[:2]), P("x")))
    desc = sender.offer(rows, gather=False)
    assert desc["shape"] == [8, 40] and desc["dtype"] == "float32" and desc["nbytes"] == 8 * 40 * 4
    assert desc["layout"] == {"devices": 2, "shards": [[[0, 4], [0, 40]], [[4, 8], [0, 40]]],
                              "shard_shape": [4, 40], "spec": str(P("x"))}
    gathered = sender.offer(rows)                 # the default: one device's copy
    assert gathered["layout"]["devices"] == 1 and gathered["layout"]["shard_shape"] == [8, 40]
    _, receiver = ends
    receiver.pull(desc, NamedSharding(_mesh(jax.devices()[4:6]), P("x")))     # consume both offers
    receiver.pull(gathered, jax.devices()[7])


def test_a_pull_with_the_senders_layout_moves_exact_values(ends):
    sender, receiver = ends
    rows = _rows(NamedSharding(_mesh(jax.devices()[:2]), P("x")))
    target = NamedSharding(_mesh(jax.devices()[4:6], "y"), P("y"))     # other mesh, other axis name, same layout
    got = receiver.pull(sender.offer(rows, gather=False), target)
    assert got.sharding == target
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rows))


@pytest.mark.parametrize("target", ["replicated", "other split", "one device", "columns"])
def test_a_pull_whose_sharding_differs_from_the_senders_is_refused(ends, target):
    """Refused with a ValueError naming both layouts, before any pull is issued (the offer is
    still there: a matching pull afterwards gets the right data)."""
    sender, receiver = ends
    rows = _rows(NamedSharding(_mesh(jax.devices()[:2]), P("x")))
    desc = sender.offer(rows, gather=False)
    wrong = {"replicated": NamedSharding(_mesh(jax.devices()[4:6]), P()),
             "other split": NamedSharding(_mesh(jax.devices()[4:8]), P("x")),
             "one device": SingleDeviceSharding(jax.devices()[4]),
             "columns": NamedSharding(_mesh(jax.devices()[4:6]), P(None, "x"))}[target]
    pulls = receiver.pulls
    with pytest.raises(ValueError, match=rf"uuid {desc['uuid']} .*target sharding .* differs from the sender's "
                                         r"\(2 device\(s\), spec .*shard shape \(4, 40\)\)") as e:
        receiver.pull(desc, wrong)
    assert layout(wrong, (8, 40))["spec"] in str(e.value) and receiver.pulls == pulls
    got = receiver.pull(desc, NamedSharding(_mesh(jax.devices()[4:6]), P("x")))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rows))


def _mesh2x2(devices):
    return jax.make_mesh((2, 2), ("x", "y"), devices=devices, axis_types=(AxisType.Auto,) * 2)


def test_a_pull_that_puts_the_same_shard_shapes_on_other_devices_is_refused(ends):
    """P("x", "y") into P("y", "x") on a 2 x 2 mesh: the same device count and shard shape
    (4, 20), but the block each device holds differs (device 1 holds rows 0-4, columns 20-40
    in one, rows 4-8, columns 0-20 in the other): refused, and a pull with the sender's own
    spec on the other mesh then gets exact values."""
    sender, receiver = ends
    rows = _rows(NamedSharding(_mesh2x2(jax.devices()[:4]), P("x", "y")))
    desc = sender.offer(rows, gather=False)
    wrong = NamedSharding(_mesh2x2(jax.devices()[4:8]), P("y", "x"))
    assert layout(wrong, (8, 40))["shard_shape"] == desc["layout"]["shard_shape"] == [4, 20]
    pulls = receiver.pulls
    with pytest.raises(ValueError, match=rf"uuid {desc['uuid']} .*differs from the sender's"):
        receiver.pull(desc, wrong)
    assert receiver.pulls == pulls
    got = receiver.pull(desc, NamedSharding(_mesh2x2(jax.devices()[4:8]), P("x", "y")))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rows))


def test_a_descriptor_without_a_layout_is_refused(ends):
    _, receiver = ends
    with pytest.raises(ValueError, match="uuid 5: the descriptor announces no layout"):
        receiver.pull({"uuid": 5, "shape": [2, 4], "dtype": "float32", "nbytes": 32}, jax.devices()[4])


def test_a_pull_past_its_deadline_raises_timeout_naming_it(ends):
    """Nothing is offered under the uuid: jax's pull returns a future at once and would wait
    for ever; the receiver's own deadline ends it. (Offered afterwards, the stranded pull
    completes, so nothing is left waiting.)"""
    sender, receiver = ends
    uuid = 987654321
    desc = {"uuid": uuid, "shape": [8, 40], "dtype": "float32", "nbytes": 8 * 40 * 4,
            "layout": layout(SingleDeviceSharding(jax.devices()[0]), (8, 40))}
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"pull of uuid {uuid} not complete after 0.5 s"):
        receiver.pull(desc, jax.devices()[4], timeout_s=0.5)
    assert 0.5 <= time.monotonic() - t0 < 5
    rows = _rows(SingleDeviceSharding(jax.devices()[0]))
    sender.server.await_pull(uuid, [rows], timeout=datetime.datetime.now() + datetime.timedelta(seconds=30))
    # and a pull offered in time is not cut short by its deadline
    got = receiver.pull(sender.offer(rows), jax.devices()[5], timeout_s=10)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rows))


def test_shared_memory_transport_moves_exact_values_once_with_the_same_checks(tmp_path):
    """transport="shm" (processes of one host): the offer writes the bytes to a file in
    shared memory and the pull reads them onto the target, with the transfer transport's
    descriptor, layout check, byte count and counters; the file is gone once pulled (a
    second pull of it fails) and close() removes what was never pulled."""
    import os
    import tempfile

    sender = ArraySender(transport="shm")
    receiver = ArrayReceiver("shm", timeout_s=5)
    assert sender.server is None and sender.address == "shm" and receiver.connection is None
    split = NamedSharding(_mesh(jax.devices()[:2]), P("x"))
    rows = _rows(split, (8, 40))
    desc = sender.offer(rows, gather=False)
    assert desc["layout"] == layout(split, (8, 40)) and os.path.exists(desc["path"])
    target = NamedSharding(_mesh(jax.devices()[4:6]), P("x"))
    got = receiver.pull(desc, target)
    assert got.sharding == target
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rows))
    assert not os.path.exists(desc["path"]) and receiver.bytes_received == 8 * 40 * 4 and receiver.pulls == 1
    with pytest.raises(FileNotFoundError):
        receiver.pull(desc, target)
    again = sender.offer(rows, gather=False)
    with pytest.raises(ValueError, match="differs from the sender's"):
        receiver.pull(again, NamedSharding(_mesh(jax.devices()[4:8]), P("x")))   # 4-way: another layout
    with pytest.raises(ValueError, match="needs the offer's path"):
        receiver.pull({k: v for k, v in again.items() if k != "path"}, target)
    sender.close()                               # what was never pulled is gone; no directory is made
    assert not os.path.exists(again["path"]) and os.path.dirname(again["path"]) in ("/dev/shm", tempfile.gettempdir())
    with pytest.raises(ValueError, match="transport must be one of"):
        ArraySender(transport="pigeon")
