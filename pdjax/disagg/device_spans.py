"""A timeline of asynchronous device work, recorded from the host.

``record(stream, name, array)`` notes the time a computation or copy was issued and starts a
watcher thread that notes when ``array`` is ready, giving a span [issued, ready] per op.
Used to show the layer-wise handoff: the copy of layer l is issued while layer l+1 computes.
``to_chrome_trace`` writes Chrome/Perfetto trace JSON (one row per stream).
"""

from __future__ import annotations

import json
import threading
import time

import jax


class DeviceSpans:
    """Spans of device work, one per :meth:`record` (see the module docstring)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.spans: list[dict] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def record(self, stream: str, name: str, array) -> dict:
        """Note ``array`` (an array or a pytree of them) issued now; its span (a dict the
        caller may annotate) gets its ``ready`` time when all of it is ready."""
        issued = time.perf_counter() - self.t0
        span = {"stream": stream, "name": name, "issued": issued, "ready": None}
        with self._lock:
            self.spans.append(span)

        def watch():
            jax.block_until_ready(array)
            span["ready"] = time.perf_counter() - self.t0
        th = threading.Thread(target=watch, daemon=True)
        th.start()
        self._threads.append(th)
        return span

    def wait(self) -> "DeviceSpans":
        for th in self._threads:
            th.join()
        return self

    def span(self, stream: str, name: str) -> dict:
        return next(s for s in self.spans if s["stream"] == stream and s["name"] == name)

    def to_chrome_trace(self, path: str | None = None) -> dict:
        streams = sorted({s["stream"] for s in self.spans})
        events = [{"name": s["name"], "cat": s["stream"], "ph": "X", "pid": 0, "tid": streams.index(s["stream"]),
                   "ts": 1e6 * s["issued"], "dur": 1e6 * ((s["ready"] or s["issued"]) - s["issued"])}
                  for s in self.spans]
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": st}}
                   for i, st in enumerate(streams)]
        trace = {"traceEvents": events, "displayTimeUnit": "ms"}
        if path:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace
