"""Reading compiled XLA programs (``compiled.as_text()``, their cost analysis) in the tests."""

import re


def stored_arrays(hlo: str) -> set:
    """(dtype, shape) of every array a compiled program stores in memory: the results of the
    instructions outside fusion bodies (a value inside a fusion lives in registers)."""
    fused = set(re.findall(r"calls=%([\w.\-]+)", hlo))
    out, inside = set(), False
    for line in hlo.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            names = [w.lstrip("%") for w in line.split()[:2]]          # "ENTRY %main", "%fused_computation"
            inside = any(n in fused for n in names)
        elif not inside:
            for dtype, dims in re.findall(r"^\s+(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]", line):
                out.add((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def bytes_accessed(compiled) -> float:
    """XLA's cost-analysis bytes accessed of a compiled program (one dict, or a list of one)."""
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["bytes accessed"]
