"""Edges of pdjax.cluster that its process-starting tests did not pin (found by mutation
testing, docs/mutation.md): the control plane's framing and errors (transfer.Control,
split_address, listen), the coordinator key-value store's translation of jax's client
(against a recording fake client, no cluster), and cluster_spec's environment checks.
In process, no child processes: each socket is closed by its test."""

import socket
import threading

import jax
import numpy as np
import pytest

from pdjax.cluster import store, transfer
from pdjax.cluster.process import ClusterSpec, cluster_spec
from pdjax.cluster.transfer import Control, listen, split_address


# ---- control plane -------------------------------------------------------------------------
@pytest.fixture
def pair():
    """Two connected Control ends over loopback TCP (``Control.connect`` to ``listen()``)."""
    server = listen()
    host, port = server.getsockname()
    assert host == transfer.LOOPBACK
    a = Control.connect(f"{host}:{port}", timeout=10)
    conn, _ = server.accept()
    b = Control(conn)
    yield a, b
    for end in (a, b):
        end.close()
    server.close()


def test_messages_round_trip_in_order_with_numpy_values(pair):
    """Framed JSON: several messages back to back arrive whole, in order, numpy scalars and
    arrays as plain numbers and lists; a value JSON cannot hold is a TypeError at send."""
    a, b = pair
    a.send({"op": "layer", "uuid": np.int64(7), "shape": np.array([2, 3])})
    a.send({"op": "done", "text": "x" * 70000})                 # larger than one recv
    assert b.recv(timeout=10) == {"op": "layer", "uuid": 7, "shape": [2, 3]}
    assert b.recv(timeout=10) == {"op": "done", "text": "x" * 70000}
    with pytest.raises(TypeError, match="object is not JSON serializable"):
        a.send({"bad": object()})
    assert a.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_recv_timeout_leaves_the_connection_usable_and_end_of_stream_is_none(pair):
    """recv(timeout) raises TimeoutError when no message begins in time, and the next
    message still arrives whole; a peer that closed cleanly gives None."""
    a, b = pair
    with pytest.raises(TimeoutError, match="no control message within 0.2 s"):
        b.recv(timeout=0.2)
    assert b.sock.gettimeout() is None
    a.send({"n": 1})
    assert b.recv() == {"n": 1}
    a.close()
    assert a.closed and b.recv(timeout=10) is None


def test_a_peer_gone_mid_message_or_an_oversized_header_is_a_connection_error(pair):
    """Half a frame then end of stream: ConnectionError naming the bytes read; a length past
    MAX_MESSAGE_BYTES: ConnectionError before reading it."""
    a, b = pair
    a.sock.sendall(transfer._HEADER.pack(10) + b"{}")
    a.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError, match="closed after 2 of 10 bytes"):
        b.recv(timeout=10)
    server = listen()
    c = Control.connect("%s:%d" % server.getsockname(), timeout=10)
    d = Control(server.accept()[0])
    c.sock.sendall(transfer._HEADER.pack(transfer.MAX_MESSAGE_BYTES + 1))
    with pytest.raises(ConnectionError, match=f"of {transfer.MAX_MESSAGE_BYTES + 1} bytes exceeds"):
        d.recv(timeout=10)
    c.close()
    d.close()
    server.close()


def test_connect_waits_for_a_peer_that_binds_later_and_gives_up_past_its_timeout():
    """Control.connect retries until the listener appears; with none, it raises the
    connection's OSError once ``timeout`` has passed (not at the first refusal)."""
    with socket.socket() as probe:
        probe.bind((transfer.LOOPBACK, 0))
        port = probe.getsockname()[1]
    got = {}
    late = threading.Timer(0.5, lambda: got.setdefault("server", listen(port=port)))
    late.start()
    c = Control.connect(f"{transfer.LOOPBACK}:{port}", timeout=20)
    late.join()
    assert c.sock.gettimeout() is None
    c.close()
    got["server"].close()
    import time
    t0 = time.monotonic()
    with pytest.raises(OSError):
        Control.connect(f"{transfer.LOOPBACK}:{port}", timeout=0.5)
    assert time.monotonic() - t0 >= 0.5


def test_split_address():
    """host:port split at the last colon (IPv6 hosts keep theirs); anything else a ValueError."""
    assert split_address("10.0.0.1:80") == ("10.0.0.1", 80)
    assert split_address("[::1]:9") == ("[::1]", 9)
    for bad in ("host", ":80", "host:", "host:8x"):
        with pytest.raises(ValueError, match="address must be host:port"):
            split_address(bad)


def test_single_device_gathers_onto_the_first_shards_device():
    """An offer's default copy: a one-device array as it is, a replicated one's first shard,
    a split one gathered onto the device of its first shard, with the same values."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[2:4])
    rows = np.arange(16, dtype=np.float32).reshape(4, 4)
    for spec in (P("x"), P()):
        arr = jax.device_put(rows, NamedSharding(mesh, spec))
        one = transfer.single_device(arr)
        assert one.devices() == {arr.addressable_shards[0].device} == {jax.devices()[2]}
        np.testing.assert_array_equal(np.asarray(one), rows)
    alone = jax.device_put(rows, jax.devices()[1])
    assert transfer.single_device(alone) is alone


def test_offer_all_and_pull_all_count_bytes_and_calls_on_both_ends():
    """One uuid for several arrays: the sender counts the offer and its bytes, the receiver
    the pull, its bytes and a positive throughput; a target count other than the announced
    arrays' is refused before pulling."""
    sender = transfer.ArraySender(transfer.start_transfer_server(jax.devices()[:2]))
    receiver = transfer.ArrayReceiver(sender.address, transfer.start_transfer_server(jax.devices()[2:4]))
    assert receiver.throughput_Bps == 0.0 and receiver.timeout_s == 60.0
    a = jax.device_put(np.arange(6, dtype=np.float32), jax.devices()[0])
    b = jax.device_put(np.ones((2, 3), np.int32), jax.devices()[1])
    desc = sender.offer_all([a, b])
    assert desc["nbytes"] == 24 + 24 and sender.bytes_offered == 48 and sender.offers == 1
    with pytest.raises(ValueError, match="2 arrays announced, 1 targets given"):
        receiver.pull_all(desc, [jax.devices()[2]])
    got = receiver.pull_all(desc, [jax.devices()[2], jax.devices()[3]], timeout_s=30)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(a))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(b))
    assert receiver.bytes_received == 48 and receiver.pulls == 1 and receiver.throughput_Bps > 0
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        transfer.ArrayReceiver(sender.address, receiver.server, timeout_s=0)


# ---- the coordinator's key-value store -----------------------------------------------------
class _Client:
    """Records the calls; ``fail`` is the JaxRuntimeError text the blocking calls raise."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def key_value_set(self, key, value):
        self.calls.append(("set", key, value))

    def key_value_delete(self, key):
        self.calls.append(("delete", key))

    def key_value_dir_get(self, prefix):
        return [("p/b", "2"), ("p/a", "1")]

    def _block(self, name, key, ms):
        self.calls.append((name, key, ms))
        if self.fail:
            raise jax.errors.JaxRuntimeError(self.fail)
        return "v"

    def blocking_key_value_get(self, key, ms):
        return self._block("get", key, ms)

    def wait_at_barrier(self, name, ms):
        return self._block("barrier", name, ms)


@pytest.fixture
def client(monkeypatch):
    from jax._src.distributed import global_state

    fake = _Client()
    monkeypatch.setattr(global_state, "client", fake)
    return fake


def test_store_calls_reach_the_client_with_millisecond_deadlines(client):
    """put/get/delete/keys/barrier pass through; timeouts become whole milliseconds, at
    least 1; keys come back sorted."""
    store.put("k", "v")
    assert store.get("k", 2.5) == "v"
    store.get("k", 0.0001)
    store.barrier("b", 3)
    store.barrier("b", 0)
    store.delete("k")
    assert store.keys("p/") == ["p/a", "p/b"]
    assert client.calls == [("set", "k", "v"), ("get", "k", 2500), ("get", "k", 1), ("barrier", "b", 3000),
                            ("barrier", "b", 1), ("delete", "k")]


@pytest.mark.parametrize("text, timeout", [("DEADLINE_EXCEEDED: waited", True), ("Barrier Timed Out", True),
                                           ("UNAVAILABLE: coordinator gone", False)])
def test_store_turns_jax_deadlines_into_timeout_errors_and_passes_others(client, text, timeout):
    """A deadline from jax (DEADLINE_EXCEEDED, or "timed out" in any case) is a TimeoutError
    naming the key or barrier; any other runtime error passes through unchanged."""
    client.fail = text
    for call, name in ((lambda: store.get("key1", 1), "key1"), (lambda: store.barrier("bar1", 1), "bar1")):
        if timeout:
            with pytest.raises(TimeoutError, match=f"'{name}' within 1 s"):
                call()
        else:
            with pytest.raises(jax.errors.JaxRuntimeError, match="UNAVAILABLE"):
                call()


def test_store_without_a_cluster_says_to_initialize(monkeypatch):
    from jax._src.distributed import global_state

    monkeypatch.setattr(global_state, "client", None)
    with pytest.raises(RuntimeError, match="not initialized"):
        store.put("k", "v")


def test_the_coordinator_port_check_binds_where_jax_will(monkeypatch):
    """Process 0's port check uses JAX_COORDINATOR_BIND_ADDRESS when it is set (a taken port
    there is a RuntimeError naming it), and a free port passes."""
    from pdjax.cluster.process import _check_coordinator_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", f"127.0.0.1:{taken}")
        with pytest.raises(RuntimeError, match=f"cannot bind its port 127.0.0.1:{taken}"):
            _check_coordinator_port(f"10.0.0.9:{free}")
        monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", f"127.0.0.1:{free}")
        _check_coordinator_port(f"10.0.0.9:{taken}")


# ---- cluster_spec --------------------------------------------------------------------------
def test_cluster_spec_edges():
    """PDJAX_PROCESS_ID wins over JOB_COMPLETION_INDEX; the last process id is valid and one
    past it is not; a coordinator needs a host and a numeric port."""
    base = {"PDJAX_COORDINATOR": "h:1", "PDJAX_NUM_PROCESSES": "4"}
    assert cluster_spec({**base, "PDJAX_PROCESS_ID": "1", "JOB_COMPLETION_INDEX": "3"}) == ClusterSpec("h:1", 4, 1)
    assert cluster_spec({**base, "PDJAX_PROCESS_ID": "3"}).process_id == 3
    assert cluster_spec({"JOB_COMPLETION_INDEX": "2"}) == ClusterSpec(None, None, 2)
    for env, words in (({**base, "PDJAX_PROCESS_ID": "4"}, "PDJAX_PROCESS_ID"),
                       ({**base, "PDJAX_COORDINATOR": ":1", "PDJAX_PROCESS_ID": "0"}, "host:port"),
                       ({**base, "PDJAX_COORDINATOR": "h:x", "PDJAX_PROCESS_ID": "0"}, "host:port"),
                       ({**base, "PDJAX_NUM_PROCESSES": "0", "PDJAX_PROCESS_ID": "0"}, "PDJAX_NUM_PROCESSES"),
                       ({"PDJAX_COORDINATOR": "h:1", "PDJAX_PROCESS_ID": "0"}, "must be set too"),
                       ({**base, "JOB_COMPLETION_INDEX": "x"}, "JOB_COMPLETION_INDEX must be an integer")):
        with pytest.raises(ValueError, match=words):
            cluster_spec(env)
