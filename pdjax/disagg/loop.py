"""The decode side's driver loop: one copy for the in-process engines and the decode process.

:class:`DecodeLoop` feeds a :class:`~pdjax.disagg.scheduler.DecodeScheduler` its events and
hands the actions it answers to ``carry`` (the driver: prefill workers in threads, or
control messages to a prefill process). Anything may ``post`` to its inbox from any thread:
scheduler events (stamped by the poster's clock, the loop's own) or callables
``f(loop)``, run on the loop's thread (control: a client's request, a restart, a shutdown).
Each turn releases the arrivals that are due, takes what is in the inbox (waiting only when
no request is running), ticks the scheduler's deadlines, and steps the running batch once
(under ``step_lock``: a colocated engine's pool lock, a :class:`FifoLock`).
"""

from __future__ import annotations

import collections
import contextlib
import math
import queue
import threading

from pdjax.disagg.scheduler import Stepped, Tick


class FifoLock:
    """A lock granted in request order: a prefill that releases it between chunks lets a
    decode step that is already waiting run before its next chunk."""

    def __init__(self):
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._held = False

    def __enter__(self):
        me = object()
        with self._cond:
            self._waiting.append(me)
            while self._held or self._waiting[0] is not me:
                self._cond.wait()
            self._waiting.popleft()
            self._held = True

    def __exit__(self, *exc):
        with self._cond:
            self._held = False
            self._cond.notify_all()


class DecodeLoop:
    """``clock``: ``now()`` in seconds (injectable: fault tests drive time by hand; waits are
    real and never longer than ``idle_wait_s``). ``on_event(event)``, ``on_turn()``: optional
    observers (the engines' signal sampling)."""

    def __init__(self, sched, pool, clock, carry, *, step_lock=None, on_event=None, on_turn=None,
                 idle_wait_s: float = 0.1):
        self.sched, self.pool, self.clock, self.carry = sched, pool, clock, carry
        self.step_lock = step_lock or contextlib.nullcontext()
        self.on_event, self.on_turn = on_event, on_turn
        self.idle_wait_s = idle_wait_s
        self.inbox: queue.Queue = queue.Queue()
        self.stopped = False

    def post(self, item) -> None:
        """Queue a scheduler event or a callable ``f(loop)`` (thread-safe)."""
        self.inbox.put(item)

    def handle(self, event) -> None:
        """Give the scheduler one event and carry out its actions (on the loop's thread)."""
        if self.on_event is not None:
            self.on_event(event)
        self.carry(self.sched.handle(event))

    def run(self, arrivals=(), until=None) -> None:
        """Serve until ``until()`` (default: every arrival released and every request ended)
        or a posted callable sets ``loop.stopped``. ``arrivals``: Submit events in time order,
        each released when the clock reaches its ``t``."""
        upcoming = collections.deque(arrivals)
        if until is None:
            until = lambda: not upcoming and self.sched.remaining == 0       # noqa: E731
        while not self.stopped and not until():
            # the deadlines are checked at a time read before the inbox is taken: progress
            # made (stamped and posted) by then is handled first, so an attempt is never
            # timed out while its progress waits in the inbox
            now = self.clock.now()
            while upcoming and upcoming[0].t <= now:
                self.handle(upcoming.popleft())
            for item in self._take(upcoming):
                if callable(item):
                    item(self)
                else:
                    self.handle(item)
                if self.stopped:
                    return
            self.handle(Tick(now))
            if self.on_turn is not None:
                self.on_turn()
            if self.sched.running:
                with self.step_lock:
                    tokens = self.pool.step()
                self.handle(Stepped(tokens, self.clock.now()))

    def _take(self, upcoming) -> list:
        """What is in the inbox; when idle, wait for the first item, the next arrival or the
        next deadline (at most ``idle_wait_s`` of real time)."""
        items = []
        if not self.sched.running:
            wake = min(upcoming[0].t if upcoming else math.inf, self.sched.deadline())
            try:
                items.append(self.inbox.get(timeout=min(max(wake - self.clock.now(), 0.0), self.idle_wait_s)))
            except queue.Empty:
                pass
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items
