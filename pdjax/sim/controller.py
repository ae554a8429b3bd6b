"""Dynamic P:D controller (DOPD-style): moves instances between the prefill and decode pools.

Every ``interval`` seconds it reads three signals:

* prefill queue depth (requests queued at prefill instances plus requests waiting for a
  decode slot): above ``queue_factor`` x its running mean -> add a prefill instance;
* decode KV-wait time (prefill end -> KV in the decode batch) of the requests that joined
  decode in the last interval: P95 above ``kv_wait_fraction`` x the mean TPOT of the
  requests finished in the last interval -> prefill is late: add a prefill instance;
* KV link utilisation over the last interval: above ``link_util_limit`` the transfer, not
  the prefill compute, is the bottleneck: adding prefill instances would not help
  ("gains exhausted"), so no prefill is added and the tick is logged.

Added here (not in the source): a queue that grew at each of the last ``growth_ticks``
ticks and holds more than ``queue_factor`` requests per prefill instance also adds a prefill
instance (a steadily growing queue never exceeds 2x its own running mean); and when
requests wait for decode slots (back-pressure) while
the prefill queue is below its mean, a decode instance is added. Moving an instance drains
it first (no new work; the role changes when it is empty); one move at a time, then a
``cooldown``. Every decision is logged in ``actions`` as (time, action, reason).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pdjax.arguments import check_positive


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """Thresholds of the dynamic P:D controller (module docstring): tick ``interval`` (s),
    ``queue_factor``, ``kv_wait_fraction`` of TPOT, ``link_util_limit``, the running-mean
    ``window`` (ticks), ``cooldown`` (s) between moves, pool minimums, ``growth_ticks``."""

    interval: float = 1.0
    queue_factor: float = 2.0
    kv_wait_fraction: float = 0.2
    link_util_limit: float = 0.7
    window: int = 30
    cooldown: float = 5.0
    min_prefill: int = 1
    min_decode: int = 1
    growth_ticks: int = 3

    def __post_init__(self):
        for f in ("interval", "queue_factor", "kv_wait_fraction", "link_util_limit"):
            check_positive(f"ControllerConfig.{f}", getattr(self, f))
        if self.cooldown < 0 or self.window < 1 or self.min_prefill < 1 or self.min_decode < 1:
            raise ValueError("ControllerConfig: cooldown >= 0, window >= 1, min_prefill >= 1 and "
                             "min_decode >= 1 are required")


class PDController:
    """The controller a PD simulation runs when its deployment has a ``controller``: it
    reads the three signals every ``interval`` and drains and moves instances; decisions in
    ``actions`` as (time, action, reason)."""

    def __init__(self, config: ControllerConfig):
        self.cfg = config
        self.depths: list[int] = []
        self.actions: list[tuple[float, str, str]] = []
        self.moving = None          # (instance, target pool)
        self.last_move = -math.inf
        self.last_link_busy = 0.0
        self.joined: list[float] = []     # kv waits since the last tick
        self.tpots: list[float] = []      # TPOTs since the last tick
        self.exhausted_ticks = 0

    # hooks called by the simulator
    def on_join(self, kv_wait: float) -> None:
        self.joined.append(kv_wait)

    def on_finish(self, tpot: float) -> None:
        if not math.isnan(tpot):
            self.tpots.append(tpot)

    def tick(self, sim, t: float) -> None:
        c = self.cfg
        self._finish_move(sim, t)
        depth = sum(p.queued for p in sim.prefill) + len(sim.pending)
        self.depths = (self.depths + [depth])[-c.window:]
        mean_depth = float(np.mean(self.depths))
        link_busy = sum(p.link_busy for p in sim.all_prefill)
        link_util = (link_busy - self.last_link_busy) / (c.interval * max(1, len(sim.prefill)))
        self.last_link_busy = link_busy
        kv_p95 = float(np.percentile(self.joined, 95)) if self.joined else 0.0
        tpot = float(np.mean(self.tpots)) if self.tpots else math.nan
        self.joined, self.tpots = [], []
        if self.moving is not None or t - self.last_move < c.cooldown:
            return
        want_p = ""
        recent = self.depths[-(c.growth_ticks + 1):]
        growing = (len(recent) == c.growth_ticks + 1 and all(a < b for a, b in zip(recent, recent[1:]))
                   and depth > c.queue_factor * len(sim.prefill))
        if depth > c.queue_factor * mean_depth and depth > 0 and len(self.depths) > 1:
            want_p = f"prefill queue {depth} > {c.queue_factor:g} x mean {mean_depth:.1f}"
        elif growing:
            want_p = f"prefill queue grew for {c.growth_ticks} ticks to {depth}"
        elif not math.isnan(tpot) and kv_p95 > c.kv_wait_fraction * tpot:
            want_p = f"KV-wait P95 {kv_p95 * 1e3:.1f} ms > {c.kv_wait_fraction:g} x TPOT {tpot * 1e3:.1f} ms"
        if want_p:
            if link_util > c.link_util_limit:
                self.exhausted_ticks += 1
                self.actions.append((t, "hold", f"{want_p}, but link utilisation {link_util:.0%} > "
                                                f"{c.link_util_limit:.0%}: gains exhausted"))
            elif len(sim.decode) > c.min_decode:
                self._start_move(sim, t, "prefill", want_p)
        elif sim.pending and depth <= mean_depth and len(sim.prefill) > c.min_prefill:
            self._start_move(sim, t, "decode", f"{len(sim.pending)} requests wait for decode slots")

    def _start_move(self, sim, t, target, reason):
        src = sim.decode if target == "prefill" else sim.prefill
        load = (lambda d: (d.state.total_running + sum(d.state.res_count), d.iid)) if target == "prefill" \
            else (lambda p: (p.pending_total, p.iid))
        inst = min(src, key=load)
        inst.draining = True
        src.remove(inst)
        sim.draining.append(inst)
        if target == "prefill":
            sim.migrate_reservations(inst, t)
        self.moving = (inst, target)
        self.last_move = t
        self.actions.append((t, f"drain {inst.pool} {inst.iid} -> {target}", reason))
        self._finish_move(sim, t)

    def _finish_move(self, sim, t):
        if self.moving is None:
            return
        inst, target = self.moving
        if not inst.empty:
            return
        sim.draining.remove(inst)
        inst.t_retired = t
        new = sim.new_instance(target, t)
        self.moving = None
        self.actions.append((t, f"{inst.pool} {inst.iid} is now {target} {new.iid}", "drained"))
        sim.retry_pending(t)
