"""What the serving-simulator experiments (:mod:`pdjax.sim`) share: their common config
tables (the base schema :class:`Serving`) and helpers. Each experiment is a module of its
own: ``sim_pd_vs_colocated``, ``pd_ratio_sweep``, ``afd_ratio_sweep``, ``link_bandwidth``,
``prefix_cache_capacity``.

Shared tables: ``[model]`` ``preset``; ``[hardware]`` ``name`` (a preset), ``dtype``
("bf16"/"fp8"), ``ep_size`` (accelerators per instance), ``cost`` ("linear" =
LinearStepCost.from_roofline, "roofline" = pdjax.analysis.costmodel.RooflineCostModel),
``mfu`` / ``mbu`` (linear cost only), ``link_gbps_per_gpu`` (KV link, decimal GB/s per
accelerator; default the preset's scale-out bandwidth); ``[workload]`` the fields of
:class:`pdjax.sim.WorkloadSpec`; ``[slo]`` ``ttft``, ``tpot`` (seconds), ``target``
(attainment the rate search keeps); ``[search]`` ``lo``, ``hi`` (req/s), ``duration``
(seconds of arrivals simulated at each rate; none: ``num_requests`` at every rate);
``[pd]`` extra :class:`pdjax.sim.PDDisaggregated` fields (e.g. ``token_budget``).

``scale`` multiplies the simulated traffic (``num_requests`` and ``duration``,
:func:`scaled`): the rates, deployments and SLOs stay, the statistics tighten. The
simulation is deterministic: the same config and ``workload.seed`` give the same metrics.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from pdjax.configs import PRESETS
from pdjax.experiments import progress
from pdjax.experiments.results import Result, markdown_table
from pdjax.experiments.schema import Header, knob, table
from pdjax.sim.cost import LinearStepCost
from pdjax.sim.deployment import PDDisaggregated
from pdjax.sim.metrics import SLO
from pdjax.sim.sweeps import max_rate_under_slo
from pdjax.sim.workload import WorkloadSpec, check_rate, length_dist

SIMULATOR_NOTE = "Model: discrete-event serving simulation (pdjax.sim; docs/sim.md)."


@dataclasses.dataclass(frozen=True)
class Model:
    preset: str = knob("deepseek_v3", choices=PRESETS)


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str = "h800"
    dtype: str = knob("bf16", choices=("bf16", "fp8"))
    ep_size: int = knob(1, minimum=1)
    cost: str = knob("linear", choices=("linear", "roofline"))
    mfu: float = knob(1.0, above=0)
    mbu: float = knob(1.0, above=0)
    link_gbps_per_gpu: Optional[float] = knob(None, above=0)

    def __post_init__(self):
        from pdjax.analysis import hardware
        try:
            hardware(self.name)
        except ValueError as e:
            raise ValueError(f"name: {e}") from None


@dataclasses.dataclass(frozen=True)
class Slo:
    ttft: float
    tpot: float
    target: float = knob(0.9, above=0)

    def __post_init__(self):
        for name in ("ttft", "tpot"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name}: must be a finite time > 0 seconds, got {getattr(self, name)!r}")
        if self.target > 1:
            raise ValueError(f"target: must lie in (0, 1], got {self.target!r}")


@dataclasses.dataclass(frozen=True)
class Search:
    lo: float = knob(0.25, above=0)
    hi: float = knob(8.0, above=0)
    duration: Optional[float] = knob(None, above=0)

    def __post_init__(self):
        if self.hi <= self.lo:
            raise ValueError(f"hi: must exceed lo = {self.lo}, got {self.hi}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Serving(Header):
    """The tables every serving experiment shares (its schema subclasses this)."""

    workload: WorkloadSpec
    slo: Slo
    model: Model = table(Model)
    hardware: Hardware = table(Hardware)

    def __post_init__(self):
        super().__post_init__()
        lengths = ("input", "output", "turns") + (("system_prompt_len",) if self.workload.system_prompts else ())
        for name in lengths:
            try:
                length_dist(getattr(self.workload, name))
            except ValueError as e:
                raise ValueError(f"workload.{name}: {e}") from None
        try:
            check_rate(self.workload.rate)
        except ValueError as e:
            raise ValueError(f"workload.rate: {e}") from None
        pd = getattr(self, "pd", None)
        if pd is not None:
            known = [f.name for f in dataclasses.fields(PDDisaggregated) if f.name not in ("num_prefill", "num_decode")]
            for key in pd:
                if key not in known:
                    raise ValueError(f"pd.{key}: unknown key (known: {', '.join(known)})")
            try:
                PDDisaggregated(1, 1, **{"link_bw": 1.0, **pd})
            except (TypeError, ValueError) as e:
                raise ValueError(f"pd: {e}") from None


def check_split(instances: int, prefill: int) -> None:
    """``prefill`` of ``instances`` leaves at least one decode instance (ValueError naming
    ``prefill``)."""
    if not 1 <= prefill < instances:
        raise ValueError(f"prefill: must leave at least one decode instance: 1 <= prefill < instances = "
                         f"{instances}, got {prefill}")


def scaled(c: Serving) -> Serving:
    """``c`` with ``scale`` applied: ``num_requests`` and the search's ``duration`` multiplied."""
    if c.scale == 1:
        return c
    c = dataclasses.replace(c, workload=dataclasses.replace(c.workload, num_requests=c.workload.num_requests * c.scale))
    search = getattr(c, "search", None)
    if search is not None and search.duration is not None:
        c = dataclasses.replace(c, search=dataclasses.replace(search, duration=search.duration * c.scale))
    return dataclasses.replace(c, scale=1)


def build_cost(c: Serving):
    """(cost model, hardware spec, ep_size, per-instance link bytes/s, model config)."""
    import pdjax
    from pdjax.analysis import hardware
    model = pdjax.configs.preset(c.model.preset)
    h = c.hardware
    hw = hardware(h.name)
    if h.cost == "linear":
        cost = LinearStepCost.from_roofline(model, hw, dtype=h.dtype, ep_size=h.ep_size, mfu=h.mfu, mbu=h.mbu)
    else:
        from pdjax.analysis.costmodel import RooflineCostModel
        cost = RooflineCostModel(model, hw, dtype_bytes=1 if h.dtype == "fp8" else 2, ep_size=h.ep_size)
    gbps = h.link_gbps_per_gpu
    link = h.ep_size * (gbps * 1e9 if gbps is not None else hw.link_bw("scale_out"))
    return cost, hw, h.ep_size, link, model


def slo(c: Serving) -> tuple[SLO, float]:
    """The simulator's SLO and the attainment target."""
    return SLO(c.slo.ttft, c.slo.tpot), c.slo.target


def setup(c: Serving) -> tuple:
    """What every serving experiment starts from: ``(c scaled, cost model, hardware spec,
    ep_size, per-instance link bytes/s, model config, SLO, attainment target)``
    (:func:`scaled`, :func:`build_cost`, :func:`slo`)."""
    c = scaled(c)
    return (c, *build_cost(c), *slo(c))


def pd_kwargs(c, link: float) -> dict:
    """PDDisaggregated options: the link and the config's ``[pd]`` table."""
    return {"link_bw": link, **c.pd}


def figure(**kwargs):
    """A matplotlib Figure, drawn without pyplot (no global backend or figure state), that a
    notebook shows (:class:`pdjax.schedules.Figure`)."""
    from pdjax.schedules.figure import Figure
    return Figure(**kwargs)


def result(title: str, name: str, headline: str, rows: list[dict], fig, notes: str = "", **metrics) -> Result:
    """The Result of a serving experiment: ``rows`` as the table and the metrics' ``rows``,
    the figure, the notes and the table in the body."""
    body = "\n\n".join(x for x in (notes, markdown_table(rows), SIMULATOR_NOTE) if x)
    return Result(title, headline, metrics={**metrics, "rows": rows}, tables={name: rows}, figures={name: fig},
                  body=body)


def search_rate(run, c, target: float, advance) -> dict:
    """:func:`pdjax.sim.sweeps.max_rate_under_slo` over ``c.search``, counting simulations."""
    return max_rate_under_slo(progress.counted(run, advance), lo=c.search.lo, hi=c.search.hi, target=target)
