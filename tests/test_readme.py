"""The README's Python examples run as written (every ```python block, in order, in one namespace)."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(__file__))


def python_blocks(path: str) -> list[str]:
    with open(path) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    blocks = python_blocks(os.path.join(ROOT, "README.md"))
    assert blocks, "README.md has no python example"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    assert (tmp_path / "dualpipe.png").exists()          # the example's plot was written
    assert capsys.readouterr().out                      # and it printed its results
