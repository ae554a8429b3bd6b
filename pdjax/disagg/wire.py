"""The control messages of pdjax's serving processes, one :class:`~pdjax.cluster.messages.Protocol`
per pair that talks (each message a ``TypedDict``; every one carries ``"v"`` and ``"op"``
and is checked on both ends by a :class:`~pdjax.cluster.messages.Channel`):

* :data:`CLIENT_DECODE`: the PD launcher's client (:func:`pdjax.disagg.launch_pd`) and a
  decode instance (``pdjax serve --role decode``);
* :data:`DECODE_PREFILL`: a decode instance and the prefill process: a :class:`PrefillJob`
  and ``cancel`` one way; ``hello`` and the prefill side's scheduler events the other
  (``started``, ``compiling``, ``layer`` with the link's payload, ``ready``, ``failed``;
  :func:`event_to_wire` / :func:`event_from_wire`, the receiver stamps them with its own
  clock);
* :data:`ATTENTION_FFN`: the attention side of an AF engine and an FFN process
  (:func:`pdjax.disagg.launch_ffn`).
"""

# no `from __future__ import annotations` here: Python 3.11 reads NotRequired only from
# annotations that are evaluated
import dataclasses
from typing import Any, NotRequired, TypedDict

from pdjax.cluster.messages import Protocol
from pdjax.disagg.request import SamplingParams
from pdjax.disagg.scheduler import Compiling, Failed, LayerArrived, Ready, Started

_OPS = {"started": Started, "compiling": Compiling, "layer": LayerArrived, "ready": Ready, "failed": Failed}
_NAMES = {cls: op for op, cls in _OPS.items()}


@dataclasses.dataclass(frozen=True)
class PrefillJob:
    """One prefill attempt as the prefill side sees it (JSON-able: ``to_wire``/``from_wire``)."""
    request: int
    attempt: int
    prompt: tuple
    rank: int
    sampling: SamplingParams = SamplingParams()
    use_store: bool = True
    retention: str = "chat"

    @classmethod
    def of(cls, attempt) -> "PrefillJob":
        """The job of a scheduler :class:`~pdjax.disagg.scheduler.Attempt` (``options``:
        (use the prefix store, retention class))."""
        use_store, retention = attempt.options or (True, "chat")
        req = attempt.request
        return cls(req.index, attempt.number, tuple(req.prompt), attempt.res.rank, req.sampling, use_store, retention)

    def to_wire(self) -> dict:
        return {"op": "prefill", "request": self.request, "attempt": self.attempt, "prompt": list(self.prompt),
                "rank": self.rank, "sampling": dataclasses.asdict(self.sampling), "prefix_cache": self.use_store,
                "retention": self.retention}

    @classmethod
    def from_wire(cls, msg: dict) -> "PrefillJob":
        return cls(msg["request"], msg["attempt"], tuple(int(t) for t in msg["prompt"]), msg["rank"],
                   SamplingParams(**msg["sampling"]), bool(msg["prefix_cache"]), msg["retention"])


def event_to_wire(event) -> dict:
    """A prefill-side event as a JSON object (its time stays behind: clocks are per process).
    A ``layer``'s ``rows`` must already be the link's JSON payload (a transfer descriptor)."""
    msg = {f.name: getattr(event, f.name) for f in dataclasses.fields(event) if f.name != "t"}
    msg["op"] = _NAMES[type(event)]
    return msg


def event_from_wire(msg: dict, t: float):
    """The event of a prefill-side message, stamped ``t`` by the receiver's clock."""
    cls = _OPS.get(msg.get("op"))
    if cls is None:
        raise ValueError(f"not a prefill event: {msg!r}")
    return cls(**{k: v for k, v in msg.items() if k not in ("v", "op")}, t=t)


# ---- client <-> decode ---------------------------------------------------------------------

class ClientHello(TypedDict):
    prefill: str                      # the prefill process's control address


class PrefillAddress(TypedDict):
    address: str                      # a restarted prefill process's control address


class Generate(TypedDict):
    request: int
    prompt: list
    max_new_tokens: Any               # checked by the decode side: a bad one fails its request alone
    sampling: dict                    # SamplingParams fields
    stop_tokens: list
    prefix_cache: bool
    retention: str
    handoff_timeout_s: NotRequired[Any]


class Empty(TypedDict):
    pass


class TokenOut(TypedDict):
    request: int
    token: int


class Done(TypedDict):
    request: int
    kv_bytes: int
    prefill_attempts: int
    handoff_timeouts: int
    prefix_hit_tokens: int
    prefix_errors: list
    tokens: NotRequired[list]         # one of tokens, error
    error: NotRequired[str]


class Counters(TypedDict):
    counters: dict                    # the decode process's counters and what it holds now


class PrefillLost(TypedDict):
    why: str
    address: str | None


CLIENT_DECODE = Protocol(("client", "decode"), {
    "client": {"hello": ClientHello, "prefill": PrefillAddress, "generate": Generate, "stats": Empty},
    "decode": {"token": TokenOut, "done": Done, "stats": Counters, "prefill_lost": PrefillLost}})


# ---- decode <-> prefill --------------------------------------------------------------------

class Job(TypedDict):
    request: int
    attempt: int
    prompt: list
    rank: int
    sampling: dict
    prefix_cache: bool
    retention: str


class AttemptOf(TypedDict):
    request: int
    attempt: int


class PrefillHello(TypedDict):
    transfer_address: str


class CompilingMsg(AttemptOf):
    active: bool


class LayerMsg(AttemptOf):
    layer: int
    rows: Any                         # the link's payload: a transfer descriptor
    start: int
    nbytes: int


class ReadyMsg(AttemptOf):
    first_token: int
    info: Any
    checksums: Any


class FailedMsg(AttemptOf):
    error: str
    fatal: bool


DECODE_PREFILL = Protocol(("decode", "prefill"), {
    "decode": {"prefill": Job, "cancel": AttemptOf},
    "prefill": {"hello": PrefillHello, "started": AttemptOf, "compiling": CompilingMsg, "layer": LayerMsg,
                "ready": ReadyMsg, "failed": FailedMsg}})


# ---- attention <-> FFN ---------------------------------------------------------------------

class AttentionHello(TypedDict):
    transfer: str
    ranks: int


class FFNHello(AttentionHello):
    fingerprint: list                 # routed experts' checksums, per layer and name


class MoECall(TypedDict):
    id: int
    layer: int
    desc: dict                        # the offered A2F pieces
    where: list


class MoEOut(TypedDict):
    id: int
    desc: dict                        # the offered F2A pieces
    where: list


class CallFailed(TypedDict):
    id: int | None
    error: str


ATTENTION_FFN = Protocol(("attention", "ffn"), {
    "attention": {"hello": AttentionHello, "moe": MoECall},
    "ffn": {"hello": FFNHello, "out": MoEOut, "error": CallFailed}})
