"""The example notebooks run top to bottom in a real Jupyter kernel (nbclient + ipykernel, on
this interpreter, on the CPU), some with smaller workloads (SHRINK) to keep the suite fast.
Every cell runs without error, the notebook prints its results, and every figure cell shows
its figure as an image, once: never matplotlib's bare ``<Figure size ...>`` text, which is
what a kernel shows for a Figure that has no display of its own."""

import ast
import json
import os
import re
import sys

import nbformat
import pytest
from nbclient import NotebookClient

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples")
NOTEBOOKS = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".ipynb"))

# Per notebook: (text in a code cell, what the test runs instead). The same code runs, on a
# workload that compiles and decodes less (the 200-token long prompts share a padding bucket
# with the engine tests' prompts), and a P:D sweep over 3 splits instead of 7 (a fresh kernel
# per notebook costs its start and jax's import: this keeps the file's time near exec's).
SHRINK = {"02_pd_vs_colocated.ipynb": [("n_short, short_new, long_len = 6, 160, 896",
                                        "n_short, short_new, long_len = 4, 12, 200"),
                                       ("prefill_counts=[1, 2, 3, 4, 5, 6, 7]", "prefill_counts=[2, 4, 6]")]}

# How many figure cells each notebook has (so that the rule below cannot silently find none).
FIGURE_CELLS = {"01_schedules_and_bubbles.ipynb": 2, "02_pd_vs_colocated.ipynb": 2}
# A figure cell draws (a Figure, a plot function, or a simulated Timeline, shown as its chart)
# and ends in an expression, whose value the notebook displays.
DRAWS = re.compile(r"\bFigure\(|\bplot\w*\(|\bsimulate\(")
BARE_FIGURE = re.compile(r"<Figure size [\d.]+x[\d.]+ with \d+ Axes>")
IMAGES = ("image/png", "image/svg+xml")
KERNEL = "pdjax-notebook-test"


def test_there_are_notebooks():
    assert {"01_schedules_and_bubbles.ipynb", "02_pd_vs_colocated.ipynb",
            "03_kv_cache_and_roofline.ipynb"} <= set(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_clean(name):
    """Valid nbformat 4.5 with a cell id on every cell, committed without outputs."""
    nb = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    nbformat.validate(nb)
    assert (nb.nbformat, nb.nbformat_minor) >= (4, 5) and all(cell.get("id") for cell in nb.cells)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code)


def _ends_in_expression(source: str) -> bool:
    body = ast.parse(source).body
    return bool(body) and isinstance(body[-1], ast.Expr) and not (
        isinstance(body[-1].value, ast.Call) and getattr(body[-1].value.func, "id", None) == "print")


def _is_figure_cell(cell) -> bool:
    return cell.cell_type == "code" and bool(DRAWS.search(cell.source)) and _ends_in_expression(cell.source)


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A kernelspec running ipykernel on this interpreter (this venv), on the CPU, with
    matplotlib's headless backend; found first through JUPYTER_PATH."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "pdjax tests", "language": "python",
        "env": {"JAX_PLATFORMS": "cpu", "MPLBACKEND": "Agg", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return KERNEL


def _kernel_processes() -> list:
    """Live ipykernel processes started by this process (from /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(ppid) == os.getpid() and state != "Z" and b"ipykernel_launcher" in cmdline:
            found.append(int(pid))
    return found


def _shrunk(name: str):
    nb = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    for old, new in SHRINK.get(name, []):
        hits = [cell for cell in nb.cells if cell.cell_type == "code" and old in cell.source]
        assert len(hits) == 1 and hits[0].source.count(old) == 1, f"{name}: {old!r} is no longer in one code cell"
        hits[0].source = hits[0].source.replace(old, new)
    return nb


def _cell_summary(cell) -> str:
    return f"cell {cell.get('id')} (ending {cell.source[-60:]!r})"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_a_kernel(name, kernel_name, tmp_path):
    nb = _shrunk(name)
    nb.cells.append(nbformat.v4.new_code_cell("import os, sys\nprint(sys.executable, os.environ.get('JAX_PLATFORMS'))"))
    before = set(_kernel_processes()) if os.path.isdir("/proc") else set()
    NotebookClient(nb, kernel_name=kernel_name, timeout=300, startup_timeout=120,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()   # raises on a cell's error
    if os.path.isdir("/proc"):
        assert set(_kernel_processes()) <= before, "the kernel process is still running"
    # this venv, on the CPU; a busy kernel may flush one print as several stream messages
    last = "".join(o.text for o in nb.cells.pop().outputs if o.output_type == "stream")
    assert last.split() == [sys.executable, "cpu"]
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    printed = [o for cell in code for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"]
    assert any(o.text.strip() for o in printed), f"{name} printed nothing"
    for cell in code:
        for out in cell.outputs:
            data = out.get("data", {})
            text = out.get("text", "") + data.get("text/plain", "")
            assert not (BARE_FIGURE.search(text) and not any(k in data for k in IMAGES)), \
                f"{name} {_cell_summary(cell)} shows a bare figure repr: {text!r}"
    figures = [cell for cell in code if _is_figure_cell(cell)]
    assert len(figures) == FIGURE_CELLS.get(name, 0), f"{name}: figure cells {[_cell_summary(c) for c in figures]}"
    for cell in figures:
        images = [o for o in cell.outputs if o.output_type in ("display_data", "execute_result")
                  and any(k in o.data for k in IMAGES)]
        assert len(images) == 1, f"{name} {_cell_summary(cell)}: {len(images)} image outputs, expected one"


def test_plots_display_as_images():
    """What the plotting functions return shows as one PNG in a notebook (IPython's display
    formatter, no pyplot and no inline backend), not as ``<Figure size ...>``; the figure is
    still matplotlib's (savefig, axes), and a Timeline shows its chart under HTML too."""
    from IPython.core.formatters import DisplayFormatter
    from matplotlib.figure import Figure as MatplotlibFigure

    import pdjax.schedules as pp
    from pdjax.experiments import serving
    from pdjax.schedules import Figure

    t = pp.simulate(pp.build("1f1b", 2, 4), F=1.0, B=2.0, W=1.0)
    fig = pp.plot(t)
    assert isinstance(fig, MatplotlibFigure) and len(fig.axes) == 1
    formatter = DisplayFormatter()
    for obj in (fig, Figure(figsize=(2, 1)), serving.figure(figsize=(2, 1)), t):
        data, _ = formatter.format(obj)
        assert data["image/png"][:4] == b"\x89PNG", type(obj)
    assert "data:image/png;base64," in formatter.format(t)[0]["text/html"]
    assert pp.plot(t, ax=MatplotlibFigure().subplots()).__class__ is MatplotlibFigure   # the user's figure


def test_the_library_draws_on_figures_that_display():
    """Every pdjax Figure comes from pdjax.schedules.figure: no module makes a bare
    matplotlib Figure (which a notebook would show as ``<Figure size ...>``) or uses pyplot."""
    root = os.path.join(os.path.dirname(EXAMPLES), "pdjax")
    bare = re.compile(r"^\s*(from matplotlib(\.figure|\.pyplot| import pyplot)|import matplotlib\.pyplot)", re.M)
    found = []
    for folder, _, files in os.walk(root):
        for f in files:
            path = os.path.join(folder, f)
            if f.endswith(".py") and not path.endswith(os.path.join("schedules", "figure.py")):
                with open(path) as src:
                    found += [path] if bare.search(src.read()) else []
    assert not found, found
