"""The import surface: ``import pdjax`` reaches every subpackage, lazily; the pure-Python
parts (schedules, analysis, the serving simulator) load neither jax nor tensorstore."""

import json
import subprocess
import sys

import pytest

HEAVY = ("jax", "jaxlib", "tensorstore", "orbax", "optax", "pdjax.model", "pdjax.parallel", "pdjax.disagg.engine")


def _loaded_after(statement: str) -> set:
    """Top-level names (and pdjax modules) in sys.modules after ``statement``, in a fresh interpreter."""
    code = (f"import sys; {statement}; import json; "
            "print(json.dumps(sorted(m for m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", ["pdjax", "pdjax.schedules", "pdjax.analysis", "pdjax.sim"])
def test_pure_python_parts_load_no_jax(module):
    loaded = _loaded_after(f"import {module}")
    assert module in loaded
    assert not [m for m in HEAVY if m in loaded], sorted(m for m in HEAVY if m in loaded)


@pytest.mark.parametrize("module", ["pdjax.schedules", "pdjax.pipeline"])
def test_the_schedules_load_matplotlib_only_to_plot(module):
    assert "matplotlib" not in _loaded_after(f"import {module}")
    plot = "pdjax.schedules.plot(pdjax.schedules.build('1f1b', num_ranks=2, num_microbatches=2))"
    assert "matplotlib" in _loaded_after(f"import {module}, pdjax.schedules; {plot}")
    assert "matplotlib" in _loaded_after(f"import {module}; pdjax.schedules.Figure")


def test_every_subpackage_is_an_attribute_of_pdjax():
    import pdjax

    for name in pdjax.SUBPACKAGES:
        assert getattr(pdjax, name).__name__ == f"pdjax.{name}"
        assert name in dir(pdjax)
    assert callable(pdjax.analysis.report) and callable(pdjax.pipeline.build) and callable(pdjax.sim.simulate_serving)
    assert pdjax.disagg.PDEngine.__name__ == "PDEngine" and callable(pdjax.parallel.make_mesh)
    assert callable(pdjax.model.transformer.layer) and callable(pdjax.init_params)
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        pdjax.nonsense


def test_plots_leave_the_users_matplotlib_alone(tmp_path):
    """Drawing a schedule (file or notebook PNG) neither switches the backend nor loads pyplot."""
    code = f"""
import sys, matplotlib
matplotlib.use("svg")
import pdjax.pipeline as pp
t = pp.simulate(pp.build("dualpipe", 4, 8))
pp.plot(t, {str(tmp_path / 'g.png')!r})
assert t._repr_png_()[:4] == b"\\x89PNG"
assert pp.build("1f1b", 2, 4)._repr_png_()[:4] == b"\\x89PNG"
print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["svg", "False"]
    assert (tmp_path / "g.png").stat().st_size > 1000


@pytest.mark.parametrize("old", ["pdjax.pipeline.zbv", "pdjax.pipeline.run_bubble_sweep", "pdjax.analysis.GiB",
                                 "pdjax.analysis.calibrate", "pdjax.sim.percentiles", "pdjax.disagg.launch_two_process",
                                 "pdjax.disagg.TwoProcessServer", "pdjax.disagg.FFNProcess", "pdjax.experiments.report"])
def test_no_deprecated_aliases(old):
    """0.2.0 has no aliases: a name that moved is found only at its new home (CHANGELOG.md
    lists old -> new), and its old path is an AttributeError."""
    import importlib.util
    package, name = old.rsplit(".", 1)
    with pytest.raises(AttributeError, match=f"has no attribute {name!r}"):
        getattr(importlib.import_module(package), name)
    assert importlib.util.find_spec("pdjax.deprecation") is None


def test_submodules_are_attributes_on_first_use():
    """A submodule the package's face did not import (``pdjax.sim.cost_fit``) is an attribute
    without a second import line, imported then."""
    code = ("import pdjax.sim, pdjax.analysis, sys\n"
            "assert 'pdjax.sim.cost_fit' not in sys.modules\n"
            "print(pdjax.sim.cost_fit.__name__, pdjax.analysis.units.GiB)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pdjax.sim.cost_fit", str(2**30)]


def test_a_public_name_means_one_thing_across_the_faces():
    """No name is on two faces (``pdjax.__all__`` and every subpackage's ``__all__``) as two
    different objects: ``pdjax.pipeline.simulate`` is ``pdjax.schedules.simulate``, and the
    serving simulator's is ``simulate_serving``."""
    import importlib

    import pdjax
    faces = {"pdjax": pdjax, **{s: importlib.import_module(f"pdjax.{s}") for s in pdjax.SUBPACKAGES}}
    seen: dict = {}
    for face, module in faces.items():
        for name in getattr(module, "__all__", ()):
            seen.setdefault(name, {})[face] = getattr(module, name)
    clashes = {name: sorted(where) for name, where in seen.items() if len({id(o) for o in where.values()}) > 1}
    assert not clashes, f"one name, different objects on these faces: {clashes}"
