"""Typed control messages: every process pair's vocabulary is declared once
(pdjax.disagg.wire), and a message off it (another version, an unknown op, a missing or
unknown field, a field of another type) is refused on either end with an error naming both
ends."""

import contextlib
import dataclasses
import io
import threading

import numpy as np
import pytest

from pdjax.cluster.messages import VERSION, Channel, ProtocolError
from pdjax.cluster.transfer import Control, listen
from pdjax.disagg import scheduler, wire
from pdjax.disagg.request import SamplingParams


@pytest.fixture
def raw_to_channel():
    """(a raw Control end, the decode end of DECODE_PREFILL it talks to as the prefill)."""
    lst = listen()
    raw = Control.connect("%s:%d" % lst.getsockname()[:2], timeout=10)
    ch = Channel(lst.accept()[0], wire.DECODE_PREFILL, "decode")
    lst.close()
    yield raw, ch
    raw.close()
    ch.close()


def test_a_message_round_trips_with_its_version(raw_to_channel):
    raw, ch = raw_to_channel
    raw.send({"v": VERSION, "op": "hello", "transfer_address": "127.0.0.1:1"})
    assert ch.expect("hello", timeout=10) == {"v": VERSION, "op": "hello", "transfer_address": "127.0.0.1:1"}
    ch.send({"op": "cancel", "request": np.int64(3), "attempt": 1})       # numpy ints are JSON ints
    assert raw.recv(timeout=10) == {"v": VERSION, "op": "cancel", "request": 3, "attempt": 1}


@pytest.mark.parametrize("msg, says", [
    ({"v": VERSION + 1, "op": "hello", "transfer_address": "x"}, f"message version {VERSION + 1}, this end speaks"),
    ({"op": "hello", "transfer_address": "x"}, "message version None"),
    ({"v": VERSION, "op": "prefill", "request": 0}, "unknown op 'prefill' (prefill sends compiling, failed"),
    ({"v": VERSION, "op": "ready", "request": 0, "attempt": 1, "first_token": 5, "info": None},
     "'ready' lacks field 'checksums'"),
    ({"v": VERSION, "op": "started", "request": 0, "attempt": 1, "t": 0.5}, "'started' has unknown field 't'"),
    ({"v": VERSION, "op": "started", "request": "0", "attempt": 1}, "'started' field 'request' must be int"),
    ({"v": VERSION, "op": "compiling", "request": 0, "attempt": 1, "active": 1}, "field 'active' must be bool"),
])
def test_a_message_off_the_protocol_is_refused_naming_both_ends(raw_to_channel, msg, says):
    raw, ch = raw_to_channel
    raw.send(msg)
    with pytest.raises(ProtocolError, match="^prefill -> decode: ") as e:
        ch.recv(timeout=10)
    assert says in str(e.value)


def test_a_sender_mistake_fails_where_it_is_made(raw_to_channel):
    _, ch = raw_to_channel
    with pytest.raises(ProtocolError, match=r"^decode -> prefill: 'cancel' lacks field 'attempt'"):
        ch.send({"op": "cancel", "request": 1})
    with pytest.raises(ProtocolError, match=r"^decode -> prefill: unknown op 'layer' \(decode sends cancel, prefill\)"):
        ch.send({"op": "layer", "request": 1})


def test_expect_names_what_came_instead(raw_to_channel):
    raw, ch = raw_to_channel
    raw.send({"v": VERSION, "op": "started", "request": 0, "attempt": 1})
    with pytest.raises(ProtocolError, match="prefill -> decode: expected 'hello', got 'started'"):
        ch.expect("hello", timeout=10)
    raw.close()
    with pytest.raises(ConnectionError, match="prefill -> decode: the connection closed before 'hello'"):
        ch.expect("hello", timeout=10)


def test_the_prefill_events_and_the_job_are_what_the_protocol_declares():
    """The scheduler's events cross as their fields less the receiver-stamped time, and a
    job as PrefillJob.to_wire writes it: each checked against DECODE_PREFILL."""
    prefill_sends = wire.DECODE_PREFILL.sends["prefill"]
    for op, cls in wire._OPS.items():
        spec = prefill_sends[op]
        fields = {f.name for f in dataclasses.fields(cls)} - {"t"}
        assert spec.__required_keys__ | spec.__optional_keys__ == fields, op
    events = [scheduler.Started(1, 2, 0.0), scheduler.Compiling(1, 2, True, 0.0),
              scheduler.LayerArrived(1, 2, 0, {"uuid": 3}, 0, 64, 0.0), scheduler.Ready(1, 2, 7, 0.0),
              scheduler.Failed(1, 2, "x", 0.0)]
    for event in events:
        msg = {"v": VERSION, **wire.event_to_wire(event)}
        wire.DECODE_PREFILL.check(msg, "prefill")
        assert wire.event_from_wire(msg, 1.5) == dataclasses.replace(event, t=1.5)
    job = wire.PrefillJob(1, 2, (5, 6), 0, SamplingParams(temperature=0.5))
    msg = {"v": VERSION, **job.to_wire()}
    assert wire.DECODE_PREFILL.check(msg, "decode") is msg and wire.PrefillJob.from_wire(msg) == job


def test_each_protocol_has_two_ends_and_a_hello_where_a_connection_starts():
    assert wire.CLIENT_DECODE.ends == ("client", "decode") and "hello" in wire.CLIENT_DECODE.sends["client"]
    assert "hello" in wire.DECODE_PREFILL.sends["prefill"]
    assert {"hello"} <= set(wire.ATTENTION_FFN.sends["attention"]) & set(wire.ATTENTION_FFN.sends["ffn"])
    with pytest.raises(ValueError, match="'router' is not an end of the client <-> decode protocol"):
        wire.CLIENT_DECODE.peer("router")


def test_an_ffn_process_refuses_a_message_off_its_protocol():
    """The FFN server's end of a connection (its serving loop, no devices needed before the
    first call): a call with a missing field ends that connection and says why, naming both
    ends."""
    from pdjax.disagg.afd_process import FFNServer

    server = FFNServer.__new__(FFNServer)
    server.sender = type("S", (), {"address": "127.0.0.1:1", "server": None})()
    server.pool = type("P", (), {"mesh": type("M", (), {"devices": np.zeros(2)})()})()
    server.fingerprint, server.pull_timeout_s = [], 1.0
    lst = listen()
    attention = Channel.connect("%s:%d" % lst.getsockname()[:2], wire.ATTENTION_FFN, "attention", timeout=10)
    ffn = Channel(lst.accept()[0], wire.ATTENTION_FFN, "ffn")
    lst.close()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        t = threading.Thread(target=server._serve, args=(ffn,))
        t.start()
        assert attention.expect("hello", timeout=10)["ranks"] == 2
        Control.send(attention, {"v": VERSION, "op": "hello", "transfer": "127.0.0.1:1", "ranks": 1})
        Control.send(attention, {"v": VERSION, "op": "moe", "id": 0, "layer": 1, "where": []})
        assert attention.recv(timeout=10) is None              # the FFN side closed the connection
        t.join(10)
    assert "attention -> ffn: 'moe' lacks field 'desc'" in err.getvalue()
