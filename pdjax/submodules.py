"""Submodules as attributes of their package, imported on first use (pure Python; imports
nothing of pdjax): ``pdjax.sim.policies`` works after ``import pdjax.sim`` without a
second import line."""

from __future__ import annotations

import importlib


def lazy_submodules(package: str):
    """A module-level ``__getattr__`` for ``package``: a name that is one of its submodules
    imports and returns it; any other name raises AttributeError."""
    def __getattr__(name):
        if not name.startswith("_"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise                  # the submodule exists but an import inside it failed
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
