"""The client-side router of PD serving across processes: which decode instance serves each
request, and what each request has streamed.

The per-request decision is a *policy*, a function ``policy(loads) -> instance`` over the
current load of every decode instance (``loads[k]``: requests instance ``k`` holds and has not
finished; None for an instance that is down). The default, :func:`least_loaded`, picks the
live instance holding the fewest unfinished requests, the lowest index on a tie: a batch
submitted at once alternates between equal instances. (A decode instance's own scheduler then
decides when the request is prefilled, reserves its blocks, and batches it.)

Each time a request is sent to an instance it gets a fresh wire id, so a request re-issued
after its instance died can never be confused, at the prefill process or at the client, with
what the dead instance had started. Tokens are counted per request: a re-issued request
streams (``on_token``) only the tokens past those already streamed.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Optional, Sequence


def least_loaded(loads: Sequence[Optional[int]]) -> Optional[int]:
    """The live instance (load not None) with the fewest unfinished requests (lowest index
    on a tie); None if every instance is down."""
    live = [(load, k) for k, load in enumerate(loads) if load is not None]
    return min(live)[1] if live else None


@dataclasses.dataclass
class Tracked:
    """One request of a ``generate`` call: its index there, its ``generate`` message (without
    the wire id), the instance serving it now, what came back."""
    index: int
    msg: dict
    instance: Optional[int] = None
    wire_id: Optional[int] = None
    tokens: list = dataclasses.field(default_factory=list)
    streamed: int = 0
    ttft: Optional[float] = None
    reissued: int = 0
    done: Optional[dict] = None


class Router:
    """Requests of one client over ``num_instances`` decode instances. ``up(k)`` / ``down(k)``
    say whether instance k takes requests; ``submit`` queues requests; ``assign()`` hands out
    the queue by ``policy`` and returns ``(instance, message)`` pairs to send; ``lost(k)``
    re-queues what instance ``k`` held unfinished (for re-issue); ``token`` / ``finish``
    record what an instance sent back."""

    def __init__(self, num_instances: int, policy: Callable = least_loaded, first_id: int = 0):
        self.policy = policy
        self.live = [False] * num_instances
        self.by_wire: dict[int, Tracked] = {}
        self.queue: list[Tracked] = []
        self._ids = itertools.count(first_id)
        self.served = [0] * num_instances           # requests finished per instance (since the start)

    def up(self, k: int) -> None:
        self.live[k] = True

    def loads(self) -> list:
        held = [0] * len(self.live)
        for r in self.by_wire.values():
            if r.done is None:
                held[r.instance] += 1
        return [h if alive else None for h, alive in zip(held, self.live)]

    def submit(self, reqs: Sequence[Tracked]) -> None:
        self.queue.extend(reqs)

    def assign(self) -> list[tuple[int, dict]]:
        """Queued requests to send now, each to the instance the policy picks (those left
        queued when every instance is down)."""
        out = []
        while self.queue:
            k = self.policy(self.loads())
            if k is None:
                break
            if not (0 <= k < len(self.live) and self.live[k]):
                raise ValueError(f"the routing policy picked instance {k!r}, not a live one of {self.loads()}")
            r = self.queue.pop(0)
            r.instance, r.wire_id = k, next(self._ids)
            self.by_wire[r.wire_id] = r
            out.append((k, {**r.msg, "request": r.wire_id}))
        return out

    def lost(self, k: int) -> list[Tracked]:
        """Instance ``k`` is down: its unfinished requests are queued again (re-issued at the
        next ``assign``, from their first token: tokens already streamed are not streamed
        again). Returns them."""
        self.live[k] = False
        again = [r for w, r in list(self.by_wire.items()) if r.instance == k and r.done is None]
        for r in again:
            del self.by_wire[r.wire_id]
            r.tokens, r.reissued, r.instance, r.wire_id = [], r.reissued + 1, None, None
        self.queue = again + self.queue
        return again

    def get(self, wire_id) -> Optional[Tracked]:
        return self.by_wire.get(wire_id)

    def token(self, r: Tracked, token: int, now: float) -> bool:
        """Record a token; True if it is new to the client (stream it)."""
        r.tokens.append(token)
        if r.ttft is None:
            r.ttft = now
        if len(r.tokens) > r.streamed:
            r.streamed += 1
            return True
        return False

    def finish(self, r: Tracked, msg: dict) -> None:
        r.done = msg
        self.served[r.instance] += 1

    def forget(self, reqs: Sequence[Tracked]) -> None:
        """Drop finished requests (a ``generate`` call returns)."""
        for r in reqs:
            self.by_wire.pop(r.wire_id, None)
