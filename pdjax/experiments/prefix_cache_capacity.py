"""Serving simulation: prefix-cache hit rate and TTFT against the prefix store's capacity
(multi-turn chat and shared system prompts) on a PD deployment. Shared tables and
``scale``: :mod:`pdjax.experiments.serving`."""

from __future__ import annotations

import dataclasses
from typing import Optional

from pdjax.experiments import progress, serving
from pdjax.experiments.results import Result
from pdjax.experiments.schema import knob, table
from pdjax.sim.deployment import PDDisaggregated
from pdjax.sim.simulator import simulate_serving
from pdjax.sim.prefix_cache import PrefixCache
from pdjax.sim.sweeps import workload_at_rate


@dataclasses.dataclass(frozen=True)
class Sweep:
    instances: int = knob(4, minimum=2)
    prefill: int = knob(2, minimum=1)
    block_size: int = knob(64, minimum=1)
    capacity_tokens: list[int] = knob([0, 16384, 65536, 262144, 1048576, 4194304], minimum=0, nonempty=True)
    retention: Optional[dict[str, float]] = None        # seconds a traffic class's blocks stay

    def __post_init__(self):
        serving.check_split(self.instances, self.prefill)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(serving.Serving):
    sweep: Sweep = table(Sweep)
    pd: dict = knob({})


def _plot(rows: list[dict], block_size: int, title: str):
    fig = serving.figure(figsize=(7, 4))
    ax = fig.subplots()
    xs = [max(r["capacity_tokens"], block_size) for r in rows]
    ax.plot(xs, [r["prefix_hit_rate"] for r in rows], "o-", label="prompt tokens served from cache")
    ax.set_xscale("log")
    ax.set_xlabel("prefix store capacity (tokens)")
    ax.set_ylabel("prefix hit rate")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["ttft_p90"] for r in rows], "s:", color="tab:red")
    ax2.set_ylabel("TTFT P90 (s)", color="tab:red")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def run(c: Config, out_dir: str) -> Result:
    """Prefix-cache hit rate and TTFT against store capacity (multi-turn + system prompts)."""
    c, cost, hw, ep, link, _, slo, _ = serving.setup(c)
    sw = c.sweep
    n, p, bs = sw.instances, sw.prefill, sw.block_size
    reqs = workload_at_rate(c.workload, c.workload.rate)
    rows = []
    for cap_tokens in progress.track(sw.capacity_tokens, "prefix_cache_capacity: capacities"):
        cache = PrefixCache(cap_tokens // bs, bs, retention=sw.retention)
        s = simulate_serving(PDDisaggregated(p, n - p, **serving.pd_kwargs(c, link)), cost, reqs, slo=slo,
                     prefix_cache=cache).summary
        rows.append({"capacity_tokens": cap_tokens, "prefix_hit_rate": s["prefix_hit_rate"],
                     "block_hit_rate": cache.hit_rate(), "ttft_p50": s["ttft_p50"],
                     "ttft_p90": s["ttft_p90"], "util_prefill": s["util_prefill"],
                     "evicted_blocks": cache.evicted, "slo_attainment": s["slo_attainment"]})
    fig = _plot(rows, bs, f"Prefix cache, {p}P{n - p}D, block {bs} tokens")
    top, zero = rows[-1], rows[0]
    headline = (f"prefix hit rate rises from {zero['prefix_hit_rate']:.1%} to {top['prefix_hit_rate']:.1%} "
                f"as the store grows to {top['capacity_tokens']:,} tokens; TTFT P90 "
                f"{zero['ttft_p90'] * 1e3:.0f} -> {top['ttft_p90'] * 1e3:.0f} ms")
    return serving.result("Prefix-cache hit rate vs capacity", "prefix_cache_capacity", headline, rows, fig)
