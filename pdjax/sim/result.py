"""What one simulation returns: :class:`SimResult` (the summary metrics, the requests, the
controller's actions), and :func:`collect_result`, which builds it from a finished
:class:`~pdjax.sim.simulator.Simulator` (checking the request accounting)."""

from __future__ import annotations

import dataclasses
import math

from pdjax.sim.metrics import summarize


@dataclasses.dataclass
class SimResult:
    """One simulation: ``summary`` (metrics, see :func:`pdjax.sim.metrics.summarize`), the finished
    ``requests``, the controller's ``actions`` and the number of ``events`` processed."""

    summary: dict
    requests: list
    actions: list
    events: int

    def table(self) -> list[tuple[str, str]]:
        """``(metric, value)`` rows of the summary's scalar metrics, formatted."""
        rows = []
        for key, value in self.summary.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            rows.append((key, f"{value:,}" if isinstance(value, int) else f"{value:.4g}"))
        if "events" not in self.summary:
            rows.append(("events", f"{self.events:,}"))
        return rows

    def __str__(self) -> str:
        width = max((len(k) for k, _ in self.table()), default=0)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in self.table())

    def _repr_html_(self) -> str:
        import html

        cells = "".join(f"<tr><td>{html.escape(k)}</td><td style='text-align:right'>{html.escape(v)}</td></tr>"
                        for k, v in self.table())
        return f"<table><tr><th>metric</th><th>value</th></tr>{cells}</table>"


def collect_result(sim) -> SimResult:
    """The :class:`SimResult` of ``sim`` (a :class:`~pdjax.sim.simulator.Simulator` whose
    event loop has run): asserts that every request finished or was rejected, then sums the
    pools' busy and alive times, the links' traffic and the cache and controller counters."""
    fin = sum(1 for r in sim.requests if r.status == "finished")
    rej = sum(1 for r in sim.requests if r.status == "rejected")
    assert fin + rej == len(sim.requests) and sim.outstanding == 0, \
        f"request accounting broken: {len(sim.requests)} total, {fin} finished, {rej} rejected"
    t_end = max((r.t_finish for r in sim.requests if r.status == "finished"), default=0.0)
    pools = {}
    groups = {"colocated": sim.colo} if sim.mode == "colocated" else {
        "prefill": sim.all_prefill, "decode": sim.all_decode}
    for name, insts in groups.items():
        pools[name] = (sum(i.busy_time for i in insts), sum(i.alive_time(t_end) for i in insts),
                       sum(1 for i in insts if math.isnan(i.t_retired)))
    extra = {"events": sim.events, "deployment": sim.mode,
             "instances_total": sim.dep.num_instances_total}
    if sim.cache is not None:
        extra.update(cache_blocks=len(sim.cache), cache_evicted=sim.cache.evicted,
                     cache_expired=sim.cache.expired)
    if sim.controller is not None:
        extra.update(controller_moves=sum(1 for a in sim.controller.actions if "is now" in a[1]),
                     controller_holds=sim.controller.exhausted_ticks)
    links = sim.all_prefill
    s = summarize(sim.requests, sim.slo, pools=pools, itl=(sim.itl_v, sim.itl_w),
                  transfer_bytes=sum(p.bytes_sent for p in links),
                  link_busy=sum(p.link_busy for p in links),
                  num_links=len(sim.prefill) if links else 0, extra=extra)
    return SimResult(s, sim.requests, list(sim.controller.actions) if sim.controller else [],
                     sim.events)
