"""Typed control messages between pdjax's processes.

Every pair of processes that talks over a :class:`~pdjax.cluster.transfer.Control`
connection declares its vocabulary once, as a :class:`Protocol`: its two ends and, for each
end, the messages that end sends, one ``TypedDict`` per op (its fields with their JSON
types, ``NotRequired`` for the optional ones). A :class:`Channel` is one end of such a
connection. Every message it sends or receives carries ``"v"`` (:data:`VERSION`) and
``"op"`` and is checked against the vocabulary: another version, an op the sending end does
not send, a missing or unknown field or a field of another type raises
:class:`ProtocolError` naming both ends (``"prefill -> decode: 'layer' lacks field
'rows'"``). Outgoing messages are checked too, so a sender's mistake fails where it is made.

The protocols are declared in :mod:`pdjax.disagg.wire` (client <-> decode, decode <->
prefill, attention <-> FFN).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from collections.abc import Mapping

from pdjax.cluster.transfer import Control

VERSION = 1
_HEAD = ("v", "op")


class ProtocolError(ValueError):
    """A control message that does not follow its protocol (the message names both ends)."""


def _accepts(kind, value) -> bool:
    """Whether ``value`` may stand in a field typed ``kind`` (numpy scalars and arrays count
    as the JSON values they are sent as)."""
    if kind is typing.Any:
        return True
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return any(_accepts(k, value) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool) or type(value).__name__ == "bool_"
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    if kind is list:
        return isinstance(value, (list, tuple)) or type(value).__name__ == "ndarray"
    return isinstance(value, typing.get_origin(kind) or kind)


@dataclasses.dataclass(frozen=True)
class Protocol:
    """The vocabulary of one connection: ``ends`` (the two process roles) and ``sends``:
    end -> {op: TypedDict of that op's fields}."""
    ends: tuple[str, str]
    sends: Mapping[str, Mapping[str, type]]

    def __post_init__(self):
        if len(self.ends) != 2 or set(self.sends) != set(self.ends):
            raise ValueError(f"a protocol has two ends, each with its messages: {self.ends} vs {sorted(self.sends)}")

    def peer(self, end: str) -> str:
        if end not in self.ends:
            raise ValueError(f"{end!r} is not an end of the {' <-> '.join(self.ends)} protocol")
        return self.ends[1 - self.ends.index(end)]

    def with_ops(self, end: str, ops: Mapping[str, type]) -> "Protocol":
        """This protocol with more ops sent by ``end`` (a test's fault injection)."""
        self.peer(end)
        return dataclasses.replace(self, sends={**self.sends, end: {**self.sends[end], **ops}})

    def check(self, msg, sender: str) -> dict:
        """``msg`` if it is a message ``sender`` may send; else :class:`ProtocolError`."""
        where = f"{sender} -> {self.peer(sender)}"
        if not isinstance(msg, dict):
            raise ProtocolError(f"{where}: a message is a JSON object, got {type(msg).__name__}")
        if msg.get("v") != VERSION:
            raise ProtocolError(f"{where}: message version {msg.get('v')!r}, this end speaks version {VERSION} "
                                f"(op {msg.get('op')!r})")
        kinds = self.sends[sender]
        op = msg.get("op")
        if op not in kinds:
            raise ProtocolError(f"{where}: unknown op {op!r} ({sender} sends {', '.join(sorted(kinds))})")
        spec = kinds[op]
        fields = set(msg) - set(_HEAD)
        if missing := sorted(spec.__required_keys__ - fields):
            raise ProtocolError(f"{where}: {op!r} lacks field{'s' if len(missing) > 1 else ''} "
                                f"{', '.join(map(repr, missing))}")
        if unknown := sorted(fields - spec.__required_keys__ - spec.__optional_keys__):
            raise ProtocolError(f"{where}: {op!r} has unknown field{'s' if len(unknown) > 1 else ''} "
                                f"{', '.join(map(repr, unknown))}")
        for name, kind in _hints(spec).items():
            if name in msg and not _accepts(kind, msg[name]):
                raise ProtocolError(f"{where}: {op!r} field {name!r} must be {_name(kind)}, "
                                    f"got {type(msg[name]).__name__} {msg[name]!r:.80}")
        return msg


@functools.lru_cache(maxsize=None)
def _hints(spec: type) -> dict:
    return typing.get_type_hints(spec)


def _name(kind) -> str:
    return " or ".join(_name(k) for k in typing.get_args(kind)) if typing.get_args(kind) else \
        getattr(kind, "__name__", str(kind))


class Channel(Control):
    """One end (``me``) of a control connection speaking ``protocol``: :meth:`send` stamps
    and checks each message, :meth:`recv` checks what the peer sent (see the module
    docstring)."""

    def __init__(self, sock, protocol: Protocol, me: str):
        super().__init__(sock)
        self.protocol, self.me, self.peer = protocol, me, protocol.peer(me)

    @classmethod
    def connect(cls, address: str, protocol: Protocol, me: str, timeout: float = 30.0) -> "Channel":
        """Connect to ``host:port`` as end ``me`` (retrying until ``timeout`` seconds)."""
        return cls(Control.connect(address, timeout).sock, protocol, me)

    def send(self, msg: dict) -> None:
        msg = {"v": VERSION, **msg}
        super().send(self.protocol.check(msg, self.me))

    def recv(self, timeout: float | None = None) -> dict | None:
        msg = super().recv(timeout)
        return None if msg is None else self.protocol.check(msg, self.peer)

    def expect(self, op: str, timeout: float | None = None) -> dict:
        """The next message, which must be ``op`` (ConnectionError naming both ends if the
        connection ends first, :class:`ProtocolError` if another op comes)."""
        msg = self.recv(timeout)
        if msg is None:
            raise ConnectionError(f"{self.peer} -> {self.me}: the connection closed before {op!r}")
        if msg["op"] != op:
            raise ProtocolError(f"{self.peer} -> {self.me}: expected {op!r}, got {msg['op']!r}")
        return msg
