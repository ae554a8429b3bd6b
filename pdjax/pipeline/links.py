"""Stage links: how a value one rank's op produces reaches the op of another rank that
consumes it. The step runner (:class:`pdjax.pipeline.step_run.StepRun`) talks to this one
interface, whichever side of a process boundary the consumer is on:

- ``offer(key, value, sharding)`` during the producing op: the value made ready for its
  consumer (the hand-off is part of the op); returns a handle;
- ``announce(handle)`` once the op's end is recorded: from then on the consumer may take it;
- ``expect(key, failed)`` on the consumer's thread before its op: the value; TimeoutError
  past the link's deadline; :class:`Aborted` once ``failed()`` says another rank failed.

``key`` is ``(kind, stage, micro-batch)``: kind "act" (the input of ``stage``'s forward) or
"grad" (the gradient of its output), as :class:`~pdjax.pipeline.step_run.StepRun` names them.

:class:`LocalLink`: both ranks in this process; a ``device_put`` onto the consumer's
sharding, then a mailbox. :class:`ProcessLink`: the consumer in another process of a
``jax.distributed`` launch; the arrays move with :class:`~pdjax.cluster.transfer.ArraySender`
/ :class:`~pdjax.cluster.transfer.ArrayReceiver` (the transfer primitives of the KV link and
the AF exchange: every pull has a deadline and a layout check; between CPU processes of one
host their shared-memory transport), the descriptor through the cluster's key-value store
(:mod:`pdjax.cluster.store`) under a name both sides derive from the step and the key.
"""

from __future__ import annotations

import json
import threading
import time

import jax

from pdjax.cluster import store

POLL_S = 1.0            # how often a wait looks whether another rank failed


def source_stage(layout, key) -> int:
    """The stage that produces the value ``key``: an activation comes from the stage before,
    a gradient from the stage after."""
    kind, stage, _ = key
    return layout.prev_stage[stage] if kind == "act" else layout.next_stage[stage]


class Aborted(Exception):
    """Another rank failed; this one stops."""


class LocalLink:
    """Ranks of this process: values keyed by (kind, stage, micro-batch) in a mailbox."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._values: dict = {}
        self._cond = threading.Condition()
        self._failed = False

    def offer(self, key, value, sharding):
        return key, jax.device_put(value, sharding)

    def announce(self, handle) -> None:
        key, value = handle
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def expect(self, key, failed=lambda: False):
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while key not in self._values:
                if self._failed or failed():
                    raise Aborted()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no value for {key} after {self.timeout_s:.0f} s")
                self._cond.wait(min(left, POLL_S))
            return self._values.pop(key)

    def fail(self) -> None:
        """Wake every waiting consumer: a rank failed."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()


class ProcessLink:
    """Ranks in other processes of the launch. ``sender``: this process's ArraySender;
    ``receivers``: process index -> ArrayReceiver connected to that process; ``name``: the
    step's prefix in the key-value store; ``incoming``: key -> (producer's process, the
    sharding the value is pulled in, the consumer's sharding) for every value this process
    receives in the step; ``outgoing_sharding(key, ndim)``: the layout the producer offers in
    (the same split of the batch as the consumer's rank)."""

    def __init__(self, sender, receivers: dict, name: str, incoming: dict, outgoing_sharding, timeout_s: float):
        self.sender, self.receivers, self.name = sender, receivers, name
        self.incoming, self.outgoing_sharding, self.timeout_s = incoming, outgoing_sharding, timeout_s

    def _slot(self, key) -> str:
        kind, stage, mb = key
        return f"{self.name}/{kind}/{stage}/{mb}"

    def offer(self, key, value, sharding=None):
        """Offered during the producing op (a shared-memory sender copies the bytes then: the
        op's last step, timed with it); announced later."""
        want = self.outgoing_sharding(key, value.ndim)
        value = value if value.sharding == want else jax.device_put(value, want)
        return key, self.sender.offer(value, gather=False)

    def announce(self, handle) -> None:
        key, desc = handle
        store.put(self._slot(key), json.dumps(desc))

    def expect(self, key, failed=lambda: False):
        process, wire, target = self.incoming[key]
        slot = self._slot(key)
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                desc = json.loads(store.get(slot, max(min(left, POLL_S), 0.001)))
                break
            except TimeoutError:
                if failed():
                    raise Aborted() from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no value for {key} from process {process} after {self.timeout_s:.0f} s") \
                        from None
        store.delete(slot)
        value = self.receivers[process].pull(desc, wire, max(deadline - time.monotonic(), 1.0))
        return value if target == wire else jax.device_put(value, target)
