"""What crosses a process boundary between the decode and the prefill side, as JSON objects
(framed by :class:`pdjax.cluster.transfer.Control`): a :class:`PrefillJob` (decode ->
prefill), the prefill side's scheduler events (prefill -> decode: ``started``, ``compiling``, ``layer``
with the link's payload, ``ready``, ``failed``; :func:`event_to_wire` /
:func:`event_from_wire`, the receiver stamps them with its own clock), and ``cancel``.
"""

from __future__ import annotations

import dataclasses

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
    return cls(**{k: v for k, v in msg.items() if k != "op"}, t=t)
