"""Trace replay: requests from a CSV or JSONL file.

Required columns: ``arrival_time`` (seconds), ``input_len``, ``output_len`` (tokens).
Optional: ``session_id`` (turns of one session, in arrival order, extend each other:
a turn whose input is at least the previous turn's input + output reuses that context as
its prefix), ``prefix_id`` with ``prefix_len`` (a shared system prompt of ``prefix_len``
tokens at the start of the prompt), ``retention`` (traffic class for the prefix cache).
Rows are sorted by arrival time (stable). Any problem raises ValueError naming the file,
the row and the column.
"""

from __future__ import annotations

import csv
import json
import math
import os

from pdjax.sim.workload import SimRequest

REQUIRED = ("arrival_time", "input_len", "output_len")
OPTIONAL = ("session_id", "prefix_id", "prefix_len", "retention")


def _read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise ValueError(f"trace file {path!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".ndjson", ".json"):
        rows = []
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}: line {i} is not valid JSON: {e}") from None
                    if not isinstance(row, dict):
                        raise ValueError(f"{path}: line {i} is not a JSON object")
                    rows.append(row)
        return rows
    if ext in (".csv", ".tsv"):
        with open(path, newline="") as f:
            return list(csv.DictReader(f, delimiter="\t" if ext == ".tsv" else ","))
    raise ValueError(f"trace file {path!r}: unknown format {ext!r} (use .csv or .jsonl)")


def _num(path, i, row, col, kind=float):
    v = row.get(col)
    if v is None or v == "":
        raise ValueError(f"{path}: row {i} has no value in column {col!r}")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: row {i} column {col!r} is not a number: {v!r}") from None
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{path}: row {i} column {col!r} must be a finite number >= 0, got {v!r}")
    if kind is int:
        if x != int(x):
            raise ValueError(f"{path}: row {i} column {col!r} must be an integer, got {v!r}")
        return int(x)
    return x


def load_trace(path: str) -> list[SimRequest]:
    """Requests of the trace at ``path`` (.csv/.tsv or .jsonl), sorted by arrival."""
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"trace file {path!r} has no rows")
    cols = set().union(*(r.keys() for r in rows))
    missing = [c for c in REQUIRED if c not in cols]
    if missing:
        raise ValueError(f"trace file {path!r} is missing required column(s) {missing}; "
                         f"it has {sorted(cols)}")
    if "prefix_id" in cols and "prefix_len" not in cols:
        raise ValueError(f"trace file {path!r} has column 'prefix_id' but no 'prefix_len'")
    parsed = []
    for i, row in enumerate(rows, 1):
        t = _num(path, i, row, "arrival_time")
        n_in = _num(path, i, row, "input_len", int)
        n_out = _num(path, i, row, "output_len", int)
        if n_in < 1 or n_out < 1:
            raise ValueError(f"{path}: row {i}: input_len and output_len must be >= 1")
        sid = row.get("session_id")
        pid = row.get("prefix_id")
        has_pid = pid not in (None, "")
        plen = _num(path, i, row, "prefix_len", int) if has_pid else 0
        if plen >= n_in:
            raise ValueError(f"{path}: row {i}: prefix_len {plen} must be < input_len {n_in}")
        parsed.append((t, i, n_in, n_out, None if sid in (None, "") else str(sid),
                       str(pid) if has_pid else None, plen, str(row.get("retention") or "default")))
    parsed.sort(key=lambda r: (r[0], r[1]))
    prefix_ids: dict[str, int] = {}
    sessions: dict[str, tuple] = {}   # session -> (context segments, context length)
    session_ids: dict[str, int] = {}  # session -> next turn number
    session_index: dict[str, int] = {}
    next_seg = 0
    # give every prefix id its own segment id first (stable by first appearance)
    for r in parsed:
        if r[5] is not None and r[5] not in prefix_ids:
            prefix_ids[r[5]] = next_seg
            next_seg += 1
    out = []
    for rid, (t, _, n_in, n_out, sid, pid, plen, ret) in enumerate(parsed):
        ctx = sessions.get(sid) if sid is not None else None
        if ctx is not None and n_in > ctx[1]:
            segs = ctx[0] + ((next_seg, n_in - ctx[1]),)
            turn = session_ids.setdefault(sid, 0)
        elif pid is not None:
            segs = ((prefix_ids[pid], plen), (next_seg, n_in - plen))
            turn = 0
        else:
            segs = ((next_seg, n_in),)
            turn = 0
        out_seg = next_seg + 1
        next_seg += 2
        if sid is not None:
            session_ids[sid] = turn + 1
            sessions[sid] = (segs + ((out_seg, n_out),), n_in + n_out)
        out.append(SimRequest(rid, t, n_in, n_out, session_id=session_index.setdefault(sid, len(session_index)) if sid else -1,
                           turn=turn, segments=segs, out_segment=out_seg, retention=ret,
                           prefix_id=prefix_ids.get(pid, -1) if pid is not None else -1))
    return out
