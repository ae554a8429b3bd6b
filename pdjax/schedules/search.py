"""Schedule search: the least makespan under a per-rank activation-memory budget.

    res = search(num_ranks=8, num_microbatches=32, F=1.0, B=1.0, W=1.0, comm=0.05,
                 memory_budget=8, families=("zb", "v", "dualpipe"), time_limit_s=30)
    res.schedule, res.timeline, res.lower_bound, res.frontier

Costs ``F``, ``B`` (full backward; ``I = B - W`` unless ``I`` is given), ``W``, ``FB``
(an overlapped pair, default ``F + B``) are per rank of a one-stage-per-rank pipeline
(scalars or one value per rank, e.g. the executor's calibration), ``comm`` the latency of
every cross-rank dependency. ``memory`` ({"F", "I", "I_free"}, per rank) and
``memory_budget`` are in the same units, default one micro-batch's activations of one
rank's layers (1F1B peaks at ``P``). Families and their layouts:

- ``"zb"``: one stage per rank (chain): 1F1B, ZB-H1, ZB-H2 and the greedy scheduler;
- ``"v"``: ``2P`` stages in a V, each half a rank's layers (half the costs and memory):
  DualPipeV, ZB-V, V-Half, V-Min and the greedy scheduler;
- ``"dualpipe"``: two directions, ``m/2`` micro-batches each, full costs per stage
  (parameters twice): DualPipe and the greedy scheduler with and without overlapped pairs.

Every candidate is simulated (:func:`~pdjax.schedules.simulate` with the memory model),
kept if its peak fits the budget, and the least makespan wins. ``time_limit_s`` bounds the
whole search: the hand-written schedules always run (linear in the ops), the greedy pool
runs until the deadline (``SearchResult.complete`` says whether it finished), and the
MILP gets what is left. A greedy run whose cap refused nothing is the same schedule for
every larger cap, so the larger caps of that policy are skipped.

Guarantee: the pool (hand-written + greedy) does not depend on the budget, so when both
runs are ``complete`` a larger budget never gives a longer ``pool_makespan``. The MILP
(small one-stage-per-rank cases, ``num_ranks * num_microbatches <= milp_max_ops``) can
only improve on the pool, but it may prove an optimum at one budget and time out at a
larger one, so ``makespan`` itself is monotone only where the MILP finishes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from pdjax.arguments import check_int, check_positive

from .bound import lower_bound as _layout_bound
from .generators import GENERATORS
from .greedy import Policy, greedy_schedule
from .layout import Layout
from .program import DeadlockError
from .schedule import Schedule
from .simulate import Timeline, _per_stage, simulate
from .validate import ScheduleError

FAMILIES = ("zb", "v", "dualpipe")
_HAND = {"zb": ("1f1b", "zb1p", "zbh2"), "v": ("dualpipev", "zbv", "v-half", "v-min"), "dualpipe": ("dualpipe",)}


@dataclass
class Candidate:
    """One simulated schedule: its family, how it was made, peak memory, makespan."""

    family: str
    label: str
    peak_memory: float
    makespan: float
    schedule: Schedule = field(repr=False)


@dataclass
class SearchResult:
    """``schedule``/``timeline``: the best within the budget; ``lower_bound``: proven
    bound on any schedule of the searched layouts (:mod:`.bound`); ``frontier``: the
    (peak memory, makespan) Pareto points over all candidates; ``milp``: status, objective
    and dual bound of the exact program (``None`` when not run); ``candidates``: all;
    ``complete``: whether the whole greedy pool ran within ``time_limit_s``;
    ``pool_makespan``: the best fitting makespan of the pool alone (without the MILP);
    ``rejected``: ``(label, reason)`` of every built candidate that failed validation
    (dropped, never kept or returned)."""

    schedule: Schedule
    timeline: Timeline
    lower_bound: float
    frontier: list[tuple[float, float]]
    candidates: list[Candidate] = field(repr=False)
    milp: dict | None = None
    label: str = ""
    complete: bool = True
    pool_makespan: float = math.nan
    rejected: list[tuple[str, str]] = field(default_factory=list, repr=False)

    @property
    def makespan(self) -> float:
        return self.timeline.makespan

    @property
    def gap(self) -> float:
        """Relative distance to the lower bound: ``makespan / lower_bound - 1``."""
        return self.makespan / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0


def _per_rank(name: str, value, p: int, positive: bool = False) -> np.ndarray:
    return _per_stage(name, value, p, unit="rank", positive=positive)


def _layouts(p: int, m: int, families) -> dict:
    out = {}
    for fam in families:
        if fam == "zb":
            out[fam] = Layout.chain(range(p), m, num_ranks=p)
        elif fam == "v":
            out[fam] = Layout.v_shape(p, m)
        elif m % 2 == 0:   # dualpipe: half the micro-batches enter at each end
            out[fam] = Layout.bidirectional(p, m)
    return out


def _stage_view(layout: Layout, fam: str, per_rank: dict) -> dict:
    """Per-stage arrays from per-rank ones: a V stage holds half a rank's layers."""
    scale = 0.5 if fam == "v" else 1.0
    sr = np.asarray(layout.stage_rank)
    return {k: None if v is None else np.asarray(v)[sr] * (1.0 if k == "comm" else scale)
            for k, v in per_rank.items()}


def search(num_ranks: int, num_microbatches: int, F=1.0, B=2.0, W=1.0, comm=0.0, memory_budget=None,
           families=FAMILIES, time_limit_s: float = 30.0, *, I=None, FB=None, memory=None,
           milp_max_ops: int = 128) -> SearchResult:
    """Search schedules (see module docstring). Raises ValueError naming the problem
    (sizes, negative or non-finite times, ``W > B``, an unknown family, a budget below
    one micro-batch's activations) before any compute."""
    p = check_int("num_ranks", num_ranks, 1)
    m = check_int("num_microbatches", num_microbatches, 1)
    fams = tuple(families)
    unknown = [f for f in fams if f not in FAMILIES]
    if not fams or unknown:
        raise ValueError(f"families must be a non-empty subset of {FAMILIES}, got {families!r}")
    check_positive("time_limit_s", time_limit_s)
    per_rank_costs, per_rank_mem = _per_rank_inputs(p, F, B, W, comm, I, FB, memory)
    one_mb = float(np.max(per_rank_mem["F"] + per_rank_mem["I"]))
    budget = _budget(memory_budget, one_mb)
    layouts = _layouts(p, m, fams)
    deadline = time.monotonic() + float(time_limit_s)
    candidates: list[Candidate] = []
    rejected: list[tuple[str, str]] = []
    bounds, greedy_jobs = _hand_written_pool(layouts, p, m, per_rank_costs, per_rank_mem, candidates, rejected)
    complete = _greedy_pool(greedy_jobs, p, one_mb, per_rank_costs, deadline, candidates, rejected)
    if not candidates:
        raise ValueError(f"no family in {fams} supports num_ranks={p}, num_microbatches={m}")
    fitting = [cd for cd in candidates if cd.peak_memory <= budget + 1e-9]
    if not fitting:
        raise ValueError(f"no schedule found within memory_budget={memory_budget!r} "
                         f"(least peak found: {min(cd.peak_memory for cd in candidates):g})")
    best = pool_best = min(fitting, key=lambda cd: (cd.makespan, cd.peak_memory))
    milp_info = None
    left = deadline - time.monotonic()
    if "zb" in layouts and p * m <= milp_max_ops:
        milp_info, cd = _milp_candidate(layouts["zb"], per_rank_costs, per_rank_mem, fitting, budget, left,
                                        candidates, rejected)
        if cd is not None and cd.peak_memory <= budget + 1e-9 and cd.makespan < best.makespan - 1e-9:
            best = cd
    layout = best.schedule.layout
    fam = best.family
    sc = _stage_view(layout, fam, per_rank_costs)
    smem = _stage_view(layout, fam, per_rank_mem)
    timeline = simulate(best.schedule, F=sc["F"], B=sc["I"] + sc["W"], W=sc["W"], I=sc["I"], FB=sc["FB"],
                        comm=sc["comm"], memory={k: smem[k] for k in ("F", "I", "I_free")})
    return SearchResult(best.schedule, timeline, float(min(bounds)), pareto(candidates), candidates,
                        milp_info, best.label, complete, pool_best.makespan, rejected)


def _per_rank_inputs(p: int, F, B, W, comm, I, FB, memory) -> tuple[dict, dict]:
    """The checked per-rank costs ``{F, I, W, FB, comm}`` and memory ``{F, I, I_free}`` of
    :func:`search`'s arguments (``I = B - W`` and ``FB = F + I + W`` unless given)."""
    f, b, w, c = (_per_rank(n, v, p, positive=n == "F")
                  for n, v in (("F", F), ("B", B), ("W", W), ("comm", comm)))
    if I is None:
        over = np.flatnonzero(w > b)
        if over.size:
            raise ValueError(f"W ({w[over[0]]:g}) must not exceed B ({b[over[0]]:g}) at rank {int(over[0])}")
        i_ = b - w
    else:
        i_ = _per_rank("I", I, p)
    fb = f + i_ + w if FB is None else _per_rank("FB", FB, p)
    mem = dict(memory or {})
    bad = set(mem) - {"F", "I", "I_free"}
    if bad:
        raise ValueError(f"unknown memory key {sorted(bad)[0]!r}; known: ['F', 'I', 'I_free']")
    mf, mi, mif = (_per_rank(f"memory[{k!r}]", mem.get(k, dv), p) for k, dv in (("F", 1.0), ("I", 0.0), ("I_free", 0.0)))
    if np.any(mif > mf):
        raise ValueError("memory['I_free'] must not exceed memory['F']")
    return {"F": f, "I": i_, "W": w, "FB": fb, "comm": c}, {"F": mf, "I": mi, "I_free": mif}


def _budget(memory_budget, one_mb: float) -> float:
    """The per-rank memory budget (inf when None); ValueError below one micro-batch's
    activations ``one_mb``."""
    if memory_budget is None:
        return math.inf
    budget = float(check_positive("memory_budget", memory_budget))
    if not budget >= one_mb:
        raise ValueError(f"memory_budget ({memory_budget!r}) is below one micro-batch's activations "
                         f"({one_mb:g} per rank): no schedule fits")
    return budget


def _hand_written_pool(layouts: dict, p: int, m: int, per_rank_costs: dict, per_rank_mem: dict,
                       candidates: list, rejected: list) -> tuple[list, list]:
    """Add every family's hand-written schedules to ``candidates`` (cheap: linear in the
    ops, always in the pool). Returns the families' lower bounds and the greedy jobs
    ``(family, layout, stage costs, stage memory, simulate kwargs)``."""
    bounds = []
    greedy_jobs = []
    for fam, layout in layouts.items():
        sc = _stage_view(layout, fam, per_rank_costs)
        smem = _stage_view(layout, fam, per_rank_mem)
        sim_kw = dict(F=sc["F"], B=sc["I"] + sc["W"], W=sc["W"], I=sc["I"], FB=sc["FB"], comm=sc["comm"],
                      memory={k: smem[k] for k in ("F", "I", "I_free")})
        bounds.append(_layout_bound(layout, sc))
        for name in _HAND[fam]:
            try:
                sched = GENERATORS[name](p, m)
            except ValueError:
                continue   # a size the hand-written schedule does not support
            _add(candidates, rejected, fam, name, sched, sim_kw)
        greedy_jobs.append((fam, layout, sc, smem, sim_kw))
    return bounds, greedy_jobs


def _greedy_pool(greedy_jobs: list, p: int, one_mb: float, per_rank_costs: dict, deadline: float,
                 candidates: list, rejected: list) -> bool:
    """Run the greedy scheduler over its policies and caps for every job, adding each
    schedule to ``candidates``, until ``deadline``; returns whether the whole pool ran."""
    c = per_rank_costs
    complete = True
    for fam, layout, sc, smem, sim_kw in greedy_jobs:
        per_mb = float(np.max([sum(smem["F"][q] + smem["I"][q] for q in layout.stages_on_rank(r))
                               for r in range(p)]))
        # caps on a grid of whole micro-batch activations, independent of the budget
        caps = sorted({per_mb, math.inf} | {k * one_mb for k in range(1, 2 * p + 2) if k * one_mb >= per_mb})
        pairs = fam == "dualpipe" and np.any(c["FB"] < c["F"] + c["I"] + c["W"])
        policies = [Policy(ff, lag, True, ov) for ff in (False, True) for lag in (None, 0, 1)
                    for ov in ((False, True) if pairs else (False,))]
        for pol in policies:
            for cap in caps:
                if time.monotonic() > deadline:
                    complete = False
                    break
                sched = greedy_schedule(layout, F=sc["F"], I=sc["I"], W=sc["W"], FB=sc["FB"], comm=sc["comm"],
                                        cap=cap, mem_F=smem["F"], mem_I=smem["I"], mem_I_free=smem["I_free"],
                                        policy=pol, name=f"search-{fam}")
                _add(candidates, rejected, fam, f"greedy {pol.label()} cap {cap:g}", sched, sim_kw)
                if sched is not None and not sched.option("cap_binding"):
                    break   # the cap refused nothing: every larger cap builds this schedule
    return complete


def _milp_candidate(layout: Layout, per_rank_costs: dict, per_rank_mem: dict, fitting: list, budget: float,
                    left: float, candidates: list, rejected: list) -> tuple[dict, Candidate | None]:
    """The exact program on the one-stage-per-rank ``layout`` within the ``left`` seconds,
    started from the best fitting greedy makespan; returns its ``{status, objective,
    dual_bound}`` and its candidate (added to ``candidates``; None when none)."""
    if left <= 0:
        return {"status": "skipped (time limit)", "objective": None, "dual_bound": None}, None
    from .milp import milp_schedule

    sc = _stage_view(layout, "zb", per_rank_costs)
    incumbent = min((cd.makespan for cd in fitting if cd.family == "zb"), default=None)
    sched, status, obj, dual = milp_schedule(layout, sc, cap=budget, memory=per_rank_mem,
                                             upper_bound=incumbent, time_limit_s=left)
    if status == "infeasible" and incumbent is not None:
        # nothing beats the incumbent: the best greedy one-stage-per-rank schedule is optimal
        status, obj, dual = "optimal (greedy)", incumbent, incumbent
    milp_info = {"status": status, "objective": obj, "dual_bound": dual}
    cd = _add(candidates, rejected, "zb", f"milp ({status})", sched,
              dict(F=sc["F"], B=sc["I"] + sc["W"], W=sc["W"], I=sc["I"], comm=sc["comm"], memory=per_rank_mem))
    return milp_info, cd


def _add(candidates: list, rejected: list, fam: str, label: str, s: Schedule | None,
         sim_kw: dict) -> Candidate | None:
    """Validate and simulate ``s``; keep it as a candidate, or record why it was dropped
    (every candidate, hand-written, greedy or MILP, comes through here)."""
    if s is None:
        return None
    try:
        t = simulate(s, check=True, **sim_kw)
    except (ScheduleError, DeadlockError) as e:
        rejected.append((f"{fam}: {label}", str(e)))
        return None
    cd = Candidate(fam, label, float(t.peak_memory.max()), t.makespan, s)
    candidates.append(cd)
    return cd


def pareto(candidates) -> list[tuple[float, float]]:
    """(peak memory, makespan) points not dominated by another candidate, by memory."""
    pts = sorted({(round(cd.peak_memory, 9), round(cd.makespan, 9)) for cd in candidates})
    out, best = [], math.inf
    for mem, mk in pts:
        if mk < best - 1e-12:
            out.append((mem, mk))
            best = mk
    return out
