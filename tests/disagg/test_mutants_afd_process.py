"""The FFN process's failed call, both ends, without processes: a call the FFN side cannot
run is answered with the error's type and text, and the attention side raises it naming the
call (a request that then fails says why, from the other process)."""

import pytest

from pdjax.disagg.afd_process import FFNServer, RemoteFFN


class _Receiver:
    def pull_all(self, desc, targets):
        raise ValueError("pull of uuid 5: the target sharding differs from the sender's")


class _Pool:
    class mesh:
        class devices:
            flat = ["d0"]


class _Ctl:
    def __init__(self, *messages):
        self.messages = list(messages)

    def recv(self, timeout=None):
        return self.messages.pop(0) if self.messages else None


def test_a_failed_call_is_answered_with_its_error_and_raised_with_it_on_the_attention_side():
    server = object.__new__(FFNServer)            # only its call path: no devices, no sockets
    server.pool, server.calls = _Pool(), 0
    answer = server._call({"op": "moe", "id": 3, "layer": 1, "desc": {}, "where": [[0, 0, 0]]}, _Receiver(), 1)
    assert answer == {"op": "error", "id": 3,
                      "error": "ValueError: pull of uuid 5: the target sharding differs from the sender's"}
    assert server.calls == 0
    remote = object.__new__(RemoteFFN)
    remote.ctl, remote.timeout_s, remote.address = _Ctl(answer), 5.0, "127.0.0.1:1"
    with pytest.raises(RuntimeError, match=r"the FFN process failed call 3: ValueError: pull of uuid 5"):
        remote.to_attention(3)
