"""Units and input checks shared by the analysis modules.

Everything in ``pdjax.analysis`` computes in SI base units: bytes, seconds, FLOP, FLOP/s,
bytes/s. Sizes are only converted at the edge, and the unit is always named:

* decimal: ``"KB"`` = 1e3, ``"MB"`` = 1e6, ``"GB"`` = 1e9, ``"TB"`` = 1e12 bytes;
* binary: ``"KiB"`` = 2**10, ``"MiB"`` = 2**20, ``"GiB"`` = 2**30, ``"TiB"`` = 2**40 bytes.

Vendors label HBM capacity and link speeds in decimal units (GB, GB/s, TB/s); the memory
arithmetic of the source articles is in decimal units too. Mixing the two in one
computation is the error they warn about (C_max 3.76 vs 4.04), so every function that
accepts a size in a unit other than bytes takes the unit as an explicit argument.
"""

from __future__ import annotations

from pdjax.arguments import check_nonnegative

UNITS: dict[str, int | float] = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}

#: Decimal byte units (vendors' HBM and link labels): KB = 1e3 ... TB = 1e12 bytes.
KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12
#: Binary byte units: KiB = 2**10 ... TiB = 2**40 bytes.
KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40


def unit_bytes(unit: str) -> int | float:
    """Bytes in one ``unit`` ("B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB")."""
    try:
        return UNITS[unit]
    except (KeyError, TypeError):
        raise ValueError(f"unknown size unit {unit!r}; known: {sorted(UNITS)}") from None


def to_bytes(value: float, unit: str) -> float:
    """``value`` ``unit`` expressed in bytes."""
    return check_nonnegative("value", value) * unit_bytes(unit)


def from_bytes(num_bytes: float, unit: str) -> float:
    """``num_bytes`` bytes expressed in ``unit``."""
    return check_nonnegative("num_bytes", num_bytes) / unit_bytes(unit)


def format_bytes(num_bytes: float, binary: bool = True) -> str:
    """``num_bytes`` with the largest binary (KiB, MiB, GiB, TiB) or decimal (KB ... TB)
    unit that keeps the number >= 1, labelled: 70272 -> '68.6 KiB'."""
    check_nonnegative("num_bytes", num_bytes)
    units = ("KiB", "MiB", "GiB", "TiB") if binary else ("KB", "MB", "GB", "TB")
    label, size = "B", 1
    for u in units:
        if num_bytes >= UNITS[u]:
            label, size = u, UNITS[u]
    value = num_bytes / size
    return f"{value:,.0f} B" if label == "B" else f"{value:.3g} {label}"


def format_count(n: float) -> str:
    """A parameter count with a K/M/B suffix: 671026419200 -> '671B'."""
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:.0f}"
