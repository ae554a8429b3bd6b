"""Typed configs: dataclass schemas parse TOML dicts key by key."""

import dataclasses
from typing import Optional, Union

import pytest

from pdjax.experiments import schema


@dataclasses.dataclass(frozen=True)
class Inner:
    n: int = schema.knob(2, minimum=1)
    mode: str = schema.knob("a", choices=("a", "b"))

    def __post_init__(self):
        if self.n == 13:
            raise ValueError("n: unlucky")


@dataclasses.dataclass(frozen=True)
class Outer:
    required: float
    inner: Inner = schema.table(Inner)
    xs: list[float] = schema.knob([1.0], nonempty=True)
    maybe: Optional[int] = None
    length: Union[int, list, dict] = 1


def test_parse_fills_defaults_and_converts_ints_to_floats():
    c = schema.parse(Outer, {"required": 3, "xs": [1, 2.5], "length": {"kind": "fixed"}})
    assert c == Outer(3.0, Inner(), [1.0, 2.5], None, {"kind": "fixed"})
    assert isinstance(c.required, float) and schema.to_dict(c)["inner"] == {"n": 2, "mode": "a"}


@pytest.mark.parametrize("data, message", [
    ({}, "required: missing"),
    ({"required": 1, "inner": {"m": 1}}, "inner.m: unknown key"),
    ({"required": "1"}, "required: expected float, got str"),
    ({"required": 1, "inner": {"n": True}}, "inner.n: expected int, got bool"),
    ({"required": 1, "inner": {"n": 0}}, "inner.n: must be >= 1, got 0"),
    ({"required": 1, "inner": {"mode": "c"}}, "inner.mode: must be one of a, b"),
    ({"required": 1, "inner": {"n": 13}}, "inner.n: unlucky"),
    ({"required": 1, "inner": 3}, "inner: expected a table, got int"),
    ({"required": 1, "xs": []}, "xs: must not be empty"),
    ({"required": 1, "xs": [1, "2"]}, r"xs\[1\]: expected float, got str"),
    ({"required": 1, "maybe": 1.5}, "maybe: expected int, got float"),
    ({"required": 1, "length": "long"}, "length: expected int or list or table, got str"),
])
def test_errors_name_the_dotted_key(data, message):
    with pytest.raises(ValueError, match=message):
        schema.parse(Outer, data)


@pytest.mark.parametrize("data, message", [
    ({"required": float("nan")}, "required: must be a finite number, got nan"),
    ({"required": 1, "xs": [1.0, float("inf")]}, r"xs\[1\]: must be a finite number, got inf"),
    ({"required": 1, "length": {"kind": "lognormal", "mean": float("nan")}}, "length.mean: must be a finite number"),
])
def test_numbers_that_are_not_finite_are_refused_anywhere(data, message):
    with pytest.raises(ValueError, match=message):
        schema.parse(Outer, data)


def test_header_names_the_run_directory_after_the_kind():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Config(schema.Header):
        inner: Inner = schema.table(Inner)

    assert schema.parse(Config, {"kind": "k"}).name == "k"
    assert schema.parse(Config, {"kind": "k", "name": "n", "scale": 2}) == Config(kind="k", name="n", scale=2)
    with pytest.raises(ValueError, match="name: must be a non-empty directory name"):
        schema.parse(Config, {"kind": "k", "name": "a/b"})
    with pytest.raises(ValueError, match="inner.n: unlucky"):
        schema.parse(Config, {"kind": "k", "inner": {"n": 13}})
