"""Deprecated aliases, kept for one release: a package's module-level ``__getattr__`` built
from a table of where each moved name now lives (pure Python; imports nothing of pdjax)."""

from __future__ import annotations

import importlib
import warnings


def package_getattr(package: str, moved: dict, submodules=()):
    """A ``__getattr__`` for ``package``. A name in ``moved`` (name -> its home module, or
    (home module, new name), or (module, None) for a renamed module) warns with a
    DeprecationWarning naming its new home and returns it from there; a name in
    ``submodules`` imports ``package.name`` (a module not loaded yet)."""
    def __getattr__(name):
        if name in moved:
            home, attr = moved[name] if isinstance(moved[name], tuple) else (moved[name], name)
            new = home if attr is None else f"{home}.{attr}"
            warnings.warn(f"{package}.{name} moved to {new} (this alias goes in the next release)",
                          DeprecationWarning, stacklevel=2)
            module = importlib.import_module(home)
            return module if attr is None else getattr(module, attr)
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
