"""The README's Python examples run as written (every ```python block, in order, in one namespace)."""

import os

from doc_blocks import python_blocks, run_blocks

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    blocks = python_blocks(os.path.join(ROOT, "README.md"))
    assert blocks, "README.md has no python example"
    assert all(b.skip_reason is None for b in blocks), "every README example runs"
    monkeypatch.chdir(tmp_path)
    run_blocks(blocks)
    assert (tmp_path / "dualpipe.png").exists()          # the example's plot was written
    assert capsys.readouterr().out                      # and it printed its results
