"""Experiment: pdjax's deployment predictions against published measurements of real
DeepSeek-V3 deployments (:mod:`pdjax.analysis.validation_set`), and DeepSeek's own profile
and train.json reproduced as the calibration's consistency check.

Config (``pdjax run deployment_validation``; configs/deployment_validation.toml)::

    [plots]
    breakdown = true     # the predicted op-class breakdown of every deployment
    trace = ""           # a path to DeepSeek's train.json: its timeline beside the predicted pair

The table ``validation`` holds every measured figure: published, predicted, error, gate and
whether it holds; ``calibration`` the in-sample checks (DeepSeek's profile throughputs, the
train.json chunk pair per op class). docs/validation.md is this experiment's report
(``docs/make_validation.py``). Nothing here depends on ``scale``: the model is analytic.
"""

from __future__ import annotations

import dataclasses

from pdjax.experiments.results import Result
from pdjax.experiments.schema import Header, knob, table


@dataclasses.dataclass(frozen=True)
class Plots:
    breakdown: bool = knob(True)
    trace: str = knob("")

    def __post_init__(self):
        import os
        if self.trace and not os.path.isfile(self.trace):
            raise ValueError(f"plots.trace: no file {self.trace!r} (a path to train.json, or \"\")")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Header):
    plots: Plots = table(Plots)


def calibration_rows() -> list[dict]:
    """DeepSeek's own figures the model is calibrated on, predicted back (in sample)."""
    from pdjax import configs
    from pdjax.analysis import calibration as C
    from pdjax.analysis.deploy import predict
    from pdjax.analysis.deploy import profile_deployment
    from pdjax.analysis.train_pair import predict_train_pair
    rows = []
    for p in C.DEEPSEEK_PROFILE:
        got = predict(profile_deployment(p.role)).tokens_per_s_per_node
        rows.append({"name": f"DeepSeek {p.role} profile (tok/s per node)", "published": p.tokens_per_s_per_node,
                     "predicted": got, "error": got / p.tokens_per_s_per_node - 1, "gate": 0.05,
                     "in_sample": "the all-to-all factor of this role is solved on it"})
    pair = predict_train_pair(configs.deepseek_v3())
    raw = C.TRAIN_PROFILE_RAW
    measured = {**{k: v * 1e-3 for k, v in raw["class_us"].items()}, "makespan": raw["makespan_us"] * 1e-3}
    predicted = {**{k: v * 1e3 for k, v in pair.op_times.items()}, "makespan": pair.makespan_s * 1e3}
    in_sample = {"attention": "FlashAttention efficiency is read here", "dispatch": "the pair's comm factor is read here",
                 "combine": "the pair's comm factor is read here", "other": "per-token time is read here",
                 "gemm": "weight-gradient speed is read here (forward and input-gradient GEMMs are not)",
                 "makespan": "out of sample: the overlap model"}
    for k in ("gemm", "attention", "dispatch", "combine", "other", "makespan"):
        gate = 0.10 if k == "makespan" else (0.15 if k != "other" else None)
        rows.append({"name": f"train.json chunk pair: {k} (ms)", "published": measured[k], "predicted": predicted[k],
                     "error": predicted[k] / measured[k] - 1, "gate": gate, "in_sample": in_sample[k]})
    for r in rows:
        r["holds"] = None if r["gate"] is None else abs(r["error"]) <= r["gate"]
    return rows


def _figures(rows: list[dict], breakdown: bool) -> dict:
    from pdjax.schedules.figure import Figure
    tput = [r for r in rows if r["error"] is not None]
    fig = Figure(figsize=(6, 5))
    ax = fig.subplots()
    for r in tput:
        gated = r["gate"] is not None
        ax.scatter(r["published"] / 1e3, r["predicted"] / 1e3, marker="o" if gated else "x",
                   color=("tab:green" if r["holds"] else "tab:red") if gated else "grey")
    hi = max(max(r["published"], r["predicted"]) for r in tput) / 1e3 * 1.1
    ax.plot([0, hi], [0, hi], color="black", lw=1)
    for f in (0.9, 1.1):
        ax.plot([0, hi], [0, hi * f], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("published, k tokens/s per node")
    ax.set_ylabel("predicted, k tokens/s per node")
    ax.set_title("Predicted vs published (green: within its gate; x: reported only)")
    fig.tight_layout()
    figs = {"predicted_vs_published": fig}
    if breakdown:
        figs["breakdown"] = _breakdown_figure(tput)
    return figs


def _trace_figure(path: str):
    """DeepSeek's train.json beside pdjax's prediction of the same chunk pair."""
    from pdjax import configs
    from pdjax.analysis.profile import plot_profile, read_profile
    from pdjax.analysis.train_pair import predict_train_pair
    return plot_profile(read_profile(path), predicted=predict_train_pair(configs.deepseek_v3()).spans)


def _breakdown_figure(rows: list[dict]):
    from pdjax.analysis.streams import OP_CLASSES
    from pdjax.schedules.figure import Figure
    fig = Figure(figsize=(8, 0.5 * len(rows) + 1.5))
    ax = fig.subplots()
    for i, r in enumerate(rows):
        left = 0.0
        total = sum(r["breakdown"].values())
        for cls in OP_CLASSES:
            share = r["breakdown"].get(cls, 0.0) / total    # runs recorded before a class existed lack it
            ax.barh(i, share, left=left, label=cls if i == 0 else None)
            left += share
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=7)
    ax.set_xlabel("share of the op time of a step (both streams)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def _fmt(r: dict) -> dict:
    gate = r["gate"]
    return {"figure": r["name"], "published": r["published"], "predicted": r["predicted"],
            "error": r["error"], "gate": (f"{gate[0]:.0%}-{gate[1]:.0%}" if isinstance(gate, tuple)
                                          else ("reported" if gate is None else f"{gate:.0%}")),
            "holds": r["holds"]}


def run(c: Config, out_dir: str) -> Result:
    from pdjax.analysis.validation_set import validation_rows
    rows = validation_rows()
    cal = calibration_rows()
    gated = [r for r in rows if r["gate"] is not None]
    held = sum(bool(r["holds"]) for r in gated)
    headline = f"{held} of {len(gated)} gated figures within their gate"
    table_rows = [_fmt(r) for r in rows]
    metrics = {"validation": table_rows, "calibration": [_fmt(r) for r in cal], "held": held, "gated": len(gated)}
    figures = _figures(rows, c.plots.breakdown)
    if c.plots.trace:
        figures["train_pair"] = _trace_figure(c.plots.trace)
    return Result("Deployment predictions against published measurements", headline, metrics=metrics,
                  tables={"validation": table_rows, "calibration": [_fmt(r) for r in cal]},
                  figures=figures, body=render_body(rows, cal),
                  objects={"rows": rows, "calibration_rows": cal})


def _num(v, pct=False):
    if v is None:
        return "-"
    return f"{v:+.1%}" if pct else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}")


def render_body(rows: list[dict], cal: list[dict]) -> str:
    """The report's markdown: the validation table, then the calibration checks."""
    out = ["| figure | published | predicted | error | gate | holds |", "|---|---|---|---|---|---|"]
    for r in rows:
        f = _fmt(r)
        holds = "-" if r["holds"] is None else ("yes" if r["holds"] else "**no**")
        pub, pred = ((f"{r['published']:.0%}", f"{r['predicted']:.1%}") if r["error"] is None
                     else (_num(r["published"]), _num(r["predicted"])))
        out.append(f"| {r['name']} | {pub} | {pred} | {_num(r['error'], True)} | {f['gate']} | {holds} |")
    out += ["", "Calibration checks (in sample):", "",
            "| figure | DeepSeek's | predicted | error | gate | holds | what is read from it |",
            "|---|---|---|---|---|---|---|"]
    for r in cal:
        holds = "-" if r["holds"] is None else ("yes" if r["holds"] else "**no**")
        gate = "-" if r["gate"] is None else f"{r['gate']:.0%}"
        out.append(f"| {r['name']} | {_num(r['published'])} | {_num(r['predicted'])} | {_num(r['error'], True)} "
                   f"| {gate} | {holds} | {r['in_sample']} |")
    return "\n".join(out) + "\n"
