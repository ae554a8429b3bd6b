"""Typed experiment configs: TOML tables parsed into dataclasses, checked key by key.

A schema is a dataclass whose fields are the keys of one TOML table. Field types may be
``bool``, ``int``, ``float`` (an int is accepted and converted), ``str``, ``list[T]`` (also
``Sequence[T]``), ``dict`` / ``dict[str, T]`` (a free-form table), ``Optional[T]``,
``Union[...]`` (the first arm that accepts the value wins), ``Any`` and nested dataclasses
(sub-tables). :func:`parse` fills the defaults and raises ValueError naming the dotted key
(``"sweep.rates[2]: expected float, got str"``) for an unknown key, a missing required key,
a value of the wrong type, a number that is not finite (``nan``, ``inf``: anywhere in the
value, free-form tables included), or one outside the field's :func:`knob` limits
(``minimum``, ``above``, ``choices``, ``nonempty``). A dataclass's own ``__post_init__``
checks run after; their messages start with the field's name, and the table's dotted key is
put in front.

An experiment's config schema is a subclass of :class:`Header` (the top-level keys every
config shares) whose fields are its tables; its ``__post_init__`` holds the checks that
span tables (and calls ``super().__post_init__()``). Nothing here imports jax.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import math
import types
import typing
from typing import Any

# Top-level keys every experiment config shares (the schema's tables sit beside them).
HEADER_DOCS = {
    "kind": "which experiment (pdjax list shows them)",
    "name": "the run directory: runs/<name>/<timestamp>/",
    "description": "a one-line summary (pdjax list)",
    "scale": "an integer >= 1 multiplying the experiment's size (each config says what it scales)",
}


def knob(default, *, minimum=None, above=None, choices=None, nonempty: bool = False):
    """A dataclass field with a default and optional limits: numbers (or each number of a
    list) ``>= minimum`` or ``> above``; strings (or each string of a list) in ``choices``; a
    non-empty list (``nonempty``)."""
    meta = {"minimum": minimum, "above": above, "choices": tuple(choices) if choices is not None else None,
            "nonempty": nonempty}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def table(cls):
    """A dataclass field holding the sub-table ``cls`` with all its defaults."""
    return dataclasses.field(default_factory=cls)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Header:
    """The top-level keys of every experiment config (see :data:`HEADER_DOCS`); ``name``
    defaults to the kind. Experiment schemas subclass it, their tables as fields."""

    kind: str = ""
    name: str = ""
    description: str = ""
    scale: int = knob(1, minimum=1)

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.kind)
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise ValueError(f"name: must be a non-empty directory name without '/', got {self.name!r}")


def parse(cls, data, where: str = ""):
    """``data`` (a dict from TOML) as an instance of the dataclass ``cls``; see the module
    docstring for the checks. ``where`` is the dotted key of the table (for messages)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a table, got {_got(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise ValueError(f"{_key(where, key)}: unknown key (known: {', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, f in fields.items():
        key = _key(where, name)
        if name in data:
            values[name] = _value(hints[name], data[name], key)
            _check_finite(values[name], key)
            _check_limits(f, values[name], key)
        elif dataclasses.is_dataclass(hints[name]) and f.default is dataclasses.MISSING \
                and f.default_factory is dataclasses.MISSING:
            values[name] = parse(hints[name], {}, key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{key}: missing (required)")
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}.{e}" if where else str(e)) from None


def to_dict(obj) -> dict:
    """A parsed config as plain dicts and lists (JSON/TOML-ready, the runner's resolved
    config)."""
    return dataclasses.asdict(obj)


def _key(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)


def _got(value) -> str:
    if isinstance(value, dict):
        return "table"
    return type(value).__name__


def _describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "anything"
    if tp is type(None):
        return "nothing"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None))
    if tp in (list, collections.abc.Sequence) or origin in (list, collections.abc.Sequence):
        return f"list of {_describe(args[0])}" if args else "list"
    if tp is dict or origin is dict:
        return "table"
    if dataclasses.is_dataclass(tp):
        return "table"
    return getattr(tp, "__name__", str(tp))


class _Mismatch(ValueError):
    """A value that does not have the expected type (a Union tries its next arm)."""


def _value(tp, value, key: str):
    """``value`` checked (and ints converted to float) against the type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _value(arm, value, key)
            except _Mismatch:
                continue
        raise _Mismatch(f"{key}: expected {_describe(tp)}, got {_got(value)}")
    if tp in (list, collections.abc.Sequence) or origin in (list, collections.abc.Sequence):
        if not isinstance(value, list):
            raise _Mismatch(f"{key}: expected {_describe(tp)}, got {_got(value)}")
        return [_value(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch(f"{key}: expected a table, got {_got(value)}")
        if len(args) == 2:
            return {k: _value(args[1], v, f"{key}.{k}") for k, v in value.items()}
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch(f"{key}: expected a table, got {_got(value)}")
        return parse(tp, value, key)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _Mismatch(f"{key}: expected {_describe(tp)}, got {_got(value)}")


def _check_finite(value, key: str) -> None:
    """Refuse ``nan`` and ``inf`` anywhere in ``value`` (lists and free-form tables too;
    parsed sub-tables have checked their own)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key}: must be a finite number, got {value!r}")
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(v, f"{key}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{key}.{k}")


def _check_limits(field: dataclasses.Field, value, key: str) -> None:
    minimum, choices = field.metadata.get("minimum"), field.metadata.get("choices")
    if field.metadata.get("nonempty") and isinstance(value, list) and not value:
        raise ValueError(f"{key}: must not be empty")
    above = field.metadata.get("above")
    items = value if isinstance(value, list) else [value]
    for v in items:
        if minimum is not None and isinstance(v, (int, float)) and v < minimum:
            raise ValueError(f"{key}: must be >= {minimum}, got {v!r}")
        if above is not None and isinstance(v, (int, float)) and not v > above:
            raise ValueError(f"{key}: must be > {above}, got {v!r}")
        if choices is not None and isinstance(v, str) and v not in choices:
            raise ValueError(f"{key}: must be one of {', '.join(choices)}; got {v!r}")
