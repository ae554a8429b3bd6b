"""The example notebooks execute top to bottom (their code cells, in order, in one namespace,
as a kernel would run them), some with smaller workloads (SHRINK) to keep the suite fast."""

import json
import os

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples")
NOTEBOOKS = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".ipynb"))

# Per notebook: (text in a code cell, what the test runs instead). The same code runs, on a
# workload that compiles and decodes less (the 200-token long prompts share a padding bucket
# with the engine tests' prompts).
SHRINK = {"02_pd_vs_colocated.ipynb": [("n_short, short_new, long_len = 6, 160, 896",
                                        "n_short, short_new, long_len = 4, 12, 200")]}


def test_there_are_notebooks():
    assert {"01_schedules_and_bubbles.ipynb", "02_pd_vs_colocated.ipynb",
            "03_kv_cache_and_roofline.ipynb"} <= set(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, tmp_path, monkeypatch, capsys):
    with open(os.path.join(EXAMPLES, name)) as f:
        nb = json.load(f)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    cells = ["".join(cell["source"]) for cell in nb["cells"] if cell["cell_type"] == "code"]
    for old, new in SHRINK.get(name, []):
        assert sum(c.count(old) for c in cells) == 1, f"{name}: {old!r} is no longer in one code cell"
        cells = [c.replace(old, new) for c in cells]
    for i, code in enumerate(cells):
        exec(compile(code, f"{name} code cell {i}", "exec"), namespace)
    assert capsys.readouterr().out            # the notebook printed its results
