"""The import surface: ``import pdjax`` reaches every subpackage, lazily; the pure-Python
parts (schedules, analysis, the serving simulator) load neither jax nor tensorstore."""

import json
import re
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


def test_every_subpackage_is_an_attribute_of_pdjax():
    import pdjax

    for name in pdjax.SUBPACKAGES:
        assert getattr(pdjax, name).__name__ == f"pdjax.{name}"
        assert name in dir(pdjax)
    assert callable(pdjax.analysis.report) and callable(pdjax.pipeline.build) and callable(pdjax.sim.simulate)
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


@pytest.mark.parametrize("old,new", [
    ("pdjax.pipeline.zbv", "pdjax.schedules.greedy.zbv"),
    ("pdjax.pipeline.run_bubble_sweep", "pdjax.experiments.bubble_sweep.run_bubble_sweep"),
    ("pdjax.analysis.GiB", "pdjax.analysis.units.GiB"),
    ("pdjax.analysis.microbatches_for_bubble", "pdjax.schedules.formulas.min_microbatches_1f1b"),
    ("pdjax.analysis.calibrate", "pdjax.timing.calibrate"),
    ("pdjax.analysis.afd", "pdjax.analysis.afd_bounds"),
    ("pdjax.analysis.fit_prefill_cost", "pdjax.analysis.costmodel_fit.fit_prefill_cost"),
    ("pdjax.analysis.fit_decode_cost", "pdjax.analysis.costmodel_fit.fit_decode_cost"),
    ("pdjax.sim.percentiles", "pdjax.sim.metrics.percentiles"),
    ("pdjax.sim.search", "pdjax.sim.sweeps"),
])
def test_names_that_left_a_face_keep_a_deprecated_alias(old, new):
    """A name that left a subpackage's face (or moved, or was renamed) still resolves at its old
    path for one release, to the very object at its new home, with a DeprecationWarning
    naming that home."""
    import importlib

    def resolve(path):
        parts = path.split(".")
        for n in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:n]))
            except ModuleNotFoundError:
                continue
            for a in parts[n:]:
                obj = getattr(obj, a)
            return obj

    package, name = old.rsplit(".", 1)
    with pytest.warns(DeprecationWarning, match=re.escape(f"moved to {new}")):
        got = getattr(importlib.import_module(package), name)
    assert got is resolve(new)
    assert name not in importlib.import_module(package).__all__
