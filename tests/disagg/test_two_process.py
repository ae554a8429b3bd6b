"""Two-process PD serving: a prefill and a decode process (4 CPU devices each) moving the
latent KV with jax.experimental.transfer give the tokens of pdjax.generate with the prefill
process's prefix cache off and on (hits, a corrupt block recomputed), receive exactly the
latent rows, survive a decode process killed mid-request, re-prefill a request whose
handoff stalls past its deadline, and fail alone a request whose payload is malformed on
every attempt, leaking nothing in the decode process."""

import collections
import os
import sys
import time

import jax
import numpy as np
import pytest

import pdjax
from pdjax.disagg import RequestError
from pdjax.disagg import launch_pd
from pdjax.cluster.transfer import ArrayReceiver, ArraySender, Control, layout, listen

from faults import alive, inject_prefill_fault
from child_env import CHILD_ENV

NEW = 5
LONG = 40                        # prompt 200 + 40 fits max_context 256
SERVE_FAULTY = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_faulty.py")]


@pytest.fixture(scope="module")
def prompts(tiny_cfg):
    rng = np.random.RandomState(1)
    system = list(rng.randint(0, tiny_cfg.vocab_size, 20))
    out = [list(rng.randint(0, tiny_cfg.vocab_size, n)) for n in (1, 7, 200)]
    return out + [system + list(rng.randint(0, tiny_cfg.vocab_size, n)) for n in (9, 3)]   # 29, 23 tokens


@pytest.fixture(scope="module")
def expected(tiny_cfg, tiny_params, prompts):
    out = pdjax.generate(tiny_params, tiny_cfg, prompts, max_new_tokens=NEW)
    return out


@pytest.fixture(scope="module")
def server():
    srv = launch_pd("tiny", 0, prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2},
                             block_size=16, max_decode_slots=4, max_context=256, env=CHILD_ENV,
                             prefix_cache={"device_blocks": 4, "host_blocks": 64}, startup_timeout=60,
                             serve_command=SERVE_FAULTY)
    try:
        yield srv
    finally:
        srv.close()                     # SIGKILL, whatever happened
        assert len(srv.procs.started) >= 2 and not any(alive(p) for p in srv.procs.started)


def test_control_messages_round_trip():
    lst = listen()
    a = Control.connect("127.0.0.1:%d" % lst.getsockname()[1])
    b = Control(lst.accept()[0])
    try:
        a.send({"op": "layer", "shape": [3, 40], "uuid": 2**62})
        a.send({"op": "ready", "first_token": 7})
        assert b.recv() == {"op": "layer", "shape": [3, 40], "uuid": 2**62}
        assert b.recv()["first_token"] == 7
        a.close()
        assert b.recv() is None          # end of stream
    finally:
        b.close()
        lst.close()
    wide = listen("0.0.0.0")          # a configurable address: every interface, for a multi-host launch
    try:
        assert wide.getsockname()[0] == "0.0.0.0"
    finally:
        wide.close()
    with pytest.raises(ValueError, match="host:port"):
        Control.connect("no-port")


def test_transfer_channel_moves_exact_rows():
    """Offer a replicated array on 4 devices, pull it onto another device: same values,
    rows.nbytes counted on both ends (here sender and receiver share a process)."""
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,))
    for dtype in (np.float32, jax.numpy.bfloat16):
        rows = jax.device_put(np.arange(7 * 40).reshape(7, 40).astype(dtype),
                              jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        sender = ArraySender()
        receiver = ArrayReceiver(sender.address)
        desc = sender.offer(rows)
        assert desc["nbytes"] == rows.nbytes == 7 * 40 * np.dtype(dtype).itemsize
        got = receiver.pull(desc, jax.devices()[6])
        assert got.devices() == {jax.devices()[6]} and got.dtype == rows.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(rows))
        assert receiver.bytes_received == sender.bytes_offered == rows.nbytes


def test_a_pull_from_a_dead_sender_is_a_connection_error():
    """The transfer link breaking mid-pull (jax raises JaxRuntimeError: "Connection closed")
    reaches the decode server's prefill reader as ConnectionError, which it handles as the
    prefill process lost (its attempts failed and prefilled again), not as a crash of the
    reader thread that would leave them unfinished."""
    class Broken:
        def pull(self, uuid, specs):
            raise jax.errors.JaxRuntimeError("INTERNAL: SocketServer: Connection closed recv() == 0.")

    receiver = ArrayReceiver(ArraySender().address)
    receiver.connection = Broken()
    desc = {"uuid": 7, "shape": [2, 4], "dtype": "float32", "nbytes": 32,
            "layout": layout(jax.sharding.SingleDeviceSharding(jax.devices()[0]), (2, 4))}
    with pytest.raises(ConnectionError, match="uuid 7"):
        receiver.pull(desc, jax.devices()[0])


def _row_bytes(cfg):
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * 4


def test_two_process_equals_generate_and_receives_exact_latent_bytes(server, tiny_cfg, prompts, expected):
    out = server.generate(prompts, max_new_tokens=NEW, timeout=90, use_prefix_cache=False)   # cache off
    assert out == expected
    row_bytes = _row_bytes(tiny_cfg)
    for p, r in zip(prompts, server.stats["requests"]):
        assert r["kv_bytes_received"] == len(p) * row_bytes
        assert r["prefill_attempts"] == 1 and r["ttft"] > 0
        assert r["prefix_hit_tokens"] == 0 and r["handoff_timeouts"] == 0
    total = sum(len(p) for p in prompts) * row_bytes
    assert server.stats["kv_bytes_received"] == total
    link = server.stats["link"]
    assert link["kv_bytes_received"] == total
    assert link["pulls"] == len(prompts) * tiny_cfg.num_hidden_layers
    assert link["link_throughput_Bps"] > 0


def test_prefix_cache_in_prefill_process(server, tiny_cfg, prompts, expected):
    """Cache on: identical tokens cold and warm; warm, every full block but the one holding
    the last token hits (as in-process); all prompt rows still cross; a corrupt block is
    recomputed and reported."""
    assert server.generate(prompts, max_new_tokens=NEW, timeout=90) == expected
    # in order: the 29-token prompt filled the system prefix's first block before the 23-token one
    assert [r["prefix_hit_tokens"] for r in server.stats["requests"]] == [0, 0, 0, 0, 16]
    assert server.generate(prompts, max_new_tokens=NEW, timeout=90) == expected
    stats = server.stats["requests"]
    assert [r["prefix_hit_tokens"] for r in stats] == [((len(p) - 1) // 16) * 16 for p in prompts]
    assert [r["kv_bytes_received"] for r in stats] == [len(p) * _row_bytes(tiny_cfg) for p in prompts]
    assert all(r["prefill_attempts"] == 1 and r["prefix_errors"] == [] for r in stats)

    inject_prefill_fault(server, corrupt_prefix=prompts[2])
    assert server.generate([prompts[2]], max_new_tokens=NEW, timeout=60) == [expected[2]]
    r = server.stats["requests"][0]
    assert r["prefix_hit_tokens"] == 0 and r["kv_bytes_received"] == len(prompts[2]) * _row_bytes(tiny_cfg)
    assert len(r["prefix_errors"]) == 1 and "failed its checksum" in r["prefix_errors"][0]


def test_retention_class_reaches_the_prefill_store(server, prompts, expected):
    """Blocks are stored under the request's retention class; an unknown class fails that
    request alone, before any compute, naming the known classes."""
    out = server.generate([prompts[1], prompts[0]], max_new_tokens=NEW, timeout=60, retention="agent")
    assert out == [expected[1], expected[0]]
    bad = server.generate([prompts[1], prompts[0]], max_new_tokens=NEW, timeout=60, retention="forever")
    assert all(isinstance(b, RequestError) for b in bad)
    assert "unknown retention class 'forever'" in str(bad[0]) and "'agent', 'chat'" in str(bad[0])
    assert all(r["prefill_attempts"] == 1 for r in server.stats["requests"])
    assert server.generate([prompts[0]], max_new_tokens=NEW, timeout=60) == [expected[0]]


def test_bad_request_fails_alone(server, tiny_cfg, prompts, expected):
    out = server.generate([prompts[1], [], [tiny_cfg.vocab_size]], max_new_tokens=NEW, timeout=60)
    assert out[0] == expected[1]
    assert isinstance(out[1], RequestError) and "empty prompt" in str(out[1])
    assert isinstance(out[2], RequestError) and "outside" in str(out[2])


def test_decode_killed_mid_request_is_restarted_and_reissued(server, tiny_cfg, tiny_params, prompts):
    """Killed when a request is 2 tokens into LONG: the decode process cannot have finished
    its requests by then (with NEW = 5 tokens it once had, on a fast machine: the death then
    came after the last result)."""
    long_expected = pdjax.generate(tiny_params, tiny_cfg, prompts, max_new_tokens=LONG)
    old = server.pid("decode")
    restarts = server.decode_restarts
    streamed = {}
    at_kill = {}

    def on_token(i, tok):
        streamed.setdefault(i, []).append(tok)
        if not at_kill and len(streamed[i]) == 2:           # request i is 2 tokens into LONG
            at_kill.update({k: list(v) for k, v in streamed.items()})
            server.kill("decode")                         # SIGKILL
    out = server.generate(prompts, max_new_tokens=LONG, on_token=on_token, timeout=90)
    assert out == long_expected
    assert streamed == dict(enumerate(long_expected))       # each token streamed once
    assert not alive(old) and server.pid("decode") != old
    assert server.decode_restarts == restarts + 1
    # re-issued: the requests unfinished when the client saw the death (tokens already sent by
    # the killed process may still be read before it), never one that had all its tokens
    again = [i for i, r in enumerate(server.stats["requests"]) if r["reissued"]]
    assert again and all(server.stats["requests"][i]["reissued"] == 1 and len(at_kill.get(i, [])) < LONG
                         for i in again)


def test_decode_death_after_the_last_result_is_not_lost(server, prompts, expected):
    """A decode process that dies when every request is done (CI once killed it after its
    last token) is seen while the client collects the stats: it is restarted then, and the
    next generate is served (the death was once swallowed there, and every later generate
    hung on the dead instance)."""
    old = server.pid("decode")
    server.kill("decode")
    deadline = time.monotonic() + 10
    while alive(old) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.generate([], max_new_tokens=NEW, timeout=30) == []    # only the stats round
    assert server.pid("decode") != old
    assert server.generate(prompts, max_new_tokens=NEW, timeout=60) == expected


def test_stalled_handoff_times_out_and_is_prefilled_again(server, tiny_cfg, prompts, expected):
    """One request's first attempt stalls on the link at layer 1 (until decode cancels it, at
    most 30 s); its deadline (2 s without progress) expires: the reservation is
    cancelled, ``cancel`` stops the stalled attempt before it sends anything more, and the
    request is prefilled again. The request queued behind it at prefill (same 2 s deadline)
    has not started, so it does not time out. Tokens identical, nothing else retried."""
    slow = len(prompts) - 2
    inject_prefill_fault(server, fault={"kind": "stall", "layer": 1, "tokens": len(prompts[slow])})
    out = server.generate(prompts, max_new_tokens=NEW, timeout=90,
                          handoff_timeout_s=[None] * slow + [2.0, 2.0])
    assert out == expected
    stats = server.stats["requests"]
    assert [r["prefill_attempts"] for r in stats] == [1] * slow + [2, 1]
    assert [r["handoff_timeouts"] for r in stats] == [0] * slow + [1, 0]
    assert stats[slow]["kv_bytes_received"] == len(prompts[slow]) * _row_bytes(tiny_cfg)
    link = server.stats["link"]       # this call's counters (the decode process served earlier calls too)
    assert link["handoff_timeouts"] == 1
    # the abandoned attempt was cancelled before it sent layer 1: no late message at all
    assert link["stale_messages"] == 0


def test_link_faults_in_the_prefill_process_are_survived(server, tiny_cfg, prompts, expected):
    """Armed in the prefill process's link (tests/disagg/faults.py, loaded there): request 1's
    layer 1 fails to transfer, request 2's layer 2 arrives corrupt (one bit flipped on the
    wire; decode's checksum catches it before admission). Both are prefilled again; every
    token is pulled and streamed once; the other requests need one attempt."""
    inject_prefill_fault(server, fault={"kind": "fail", "layer": 1, "tokens": len(prompts[1])})
    inject_prefill_fault(server, fault={"kind": "corrupt", "layer": 2, "tokens": len(prompts[2])})
    streamed = collections.defaultdict(list)
    out = server.generate(prompts, max_new_tokens=NEW, timeout=90, use_prefix_cache=False,
                          on_token=lambda i, t: streamed[i].append(t))
    assert out == expected and dict(streamed) == dict(enumerate(expected))
    stats = server.stats["requests"]
    assert [r["prefill_attempts"] for r in stats] == [1, 2, 2, 1, 1]
    assert [r["kv_bytes_received"] for r in stats] == [len(p) * _row_bytes(tiny_cfg) for p in prompts]
    link = server.stats["link"]
    assert link["corrupt_payloads"] == 1


def test_malformed_payload_fails_its_request_alone_and_the_decode_process_leaks_nothing(server, prompts, expected):
    """The prefill process's link offers request 1's layer 1 with one row more than the
    prompt on every attempt, and request 2's in float16 on its first: the decode process
    pulls what was announced and refuses it before writing a row (the scheduler's guard
    around the pool's payload check), cancels the attempt and prefills again. Request 1
    fails alone after its 3 attempts, naming the payload; request 2's retry and the others
    give pdjax.generate's tokens. The decode process then holds no reservation, slot or
    attempt and every block is free, as before; a clean run on it follows."""
    if "instances" not in server.stats:          # run alone: a clean batch first
        assert server.generate([prompts[0]], max_new_tokens=NEW, timeout=60) == [expected[0]]
    idle, restarts = server.stats["instances"][0], server.decode_restarts   # after the previous (clean) batch
    for attempt in (1, 2, 3):
        inject_prefill_fault(server, fault={"kind": "extra_row", "layer": 1, "tokens": len(prompts[1]),
                                            "attempt": attempt})
    inject_prefill_fault(server, fault={"kind": "wrong_dtype", "layer": 1, "tokens": len(prompts[2])})
    out = server.generate(prompts, max_new_tokens=NEW, timeout=90, use_prefix_cache=False)
    assert server.decode_restarts == restarts, "the decode process died on the payload"
    assert isinstance(out[1], RequestError), out[1]
    assert "failed 3 times: malformed layer payload" in str(out[1]) and "outside its" in str(out[1])
    assert out[:1] + out[2:] == expected[:1] + expected[2:]
    assert [r["prefill_attempts"] for r in server.stats["requests"]] == [1, 3, 2, 1, 1]
    held = server.stats["instances"][0]
    assert held["malformed_payloads"] == 4                  # this call's count
    assert held["free_blocks"] == idle["free_blocks"]
    assert held["reservations"] == held["running"] == held["attempts"] == 0
    assert server.generate(prompts, max_new_tokens=NEW, timeout=90, use_prefix_cache=False) == expected
    assert server.stats["instances"][0]["free_blocks"] == idle["free_blocks"]


def test_killed_prefill_process_is_restarted_and_its_requests_reissued(server, prompts, expected):
    """The prefill process dies (SIGKILL, from its link) sending request 2's layer 1: decode
    fails the attempts it held (request 2 and the ones queued behind it), the launcher starts
    a new prefill process and gives decode its address, and decode prefills them again.
    Every token is streamed once, whichever requests had to be prefilled again. (Last in the module:
    the new prefill process starts with an empty prefix cache.)"""
    old = server.pid("prefill")
    inject_prefill_fault(server, fault={"kind": "kill", "layer": 1, "tokens": len(prompts[2])})
    streamed = collections.defaultdict(list)
    out = server.generate(prompts, max_new_tokens=NEW, timeout=120, use_prefix_cache=False,
                          on_token=lambda i, t: streamed[i].append(t))
    assert out == expected and dict(streamed) == dict(enumerate(expected))
    assert not alive(old) and server.pid("prefill") != old
    assert server.stats["prefill_restarts"] == 1 and server.stats["decode_restarts"] == 0   # this call's
    attempts = [r["prefill_attempts"] for r in server.stats["requests"]]
    # requests 2 (killed mid-send) and 3 (queued behind it) are prefilled again; 0, 1 and 4
    # once or twice: whether decode had taken their Ready before the connection dropped is a race
    assert attempts[2:4] == [2, 2] and all(a in (1, 2) for a in attempts[:2] + attempts[4:]), attempts
