"""The example notebooks execute top to bottom (their code cells, in order, in one namespace,
as a kernel would run them)."""

import json
import os

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples")
NOTEBOOKS = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".ipynb"))


def test_there_are_notebooks():
    assert {"01_schedules_and_bubbles.ipynb", "02_pd_vs_colocated.ipynb",
            "03_kv_cache_and_roofline.ipynb"} <= set(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, tmp_path, monkeypatch, capsys):
    with open(os.path.join(EXAMPLES, name)) as f:
        nb = json.load(f)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        exec(compile("".join(cell["source"]), f"{name} cell {i}", "exec"), namespace)
    assert capsys.readouterr().out            # the notebook printed its results
