"""The clock an engine stamps its events with and drives its deadlines by (seconds since it
was made; tests pass a clock of their own, e.g. one they advance by hand)."""

from __future__ import annotations

import time


class Clock:
    def __init__(self):
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0
