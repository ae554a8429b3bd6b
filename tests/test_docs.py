"""The documentation stays true to the code.

* every ```python block of docs/**/*.md runs as written (per file: in order, one namespace;
  see doc_blocks.py for the skip marker, which needs a reason and is rare);
* docs/api.md lists exactly the public names, each with a docstring summary, as
  docs/make_api.py writes it;
* docs/reproductions.md is exactly what docs/make_reproductions.py writes (each of its
  values is computed by pdjax, and the script fails if a reproduction stops matching);
* the figures the docs show exist, are the ones docs/figures/make_figures.py makes, and
  are small;
* nothing refers to documents outside the repository or to issue numbers.
"""

import glob
import importlib.util
import os
import re
import sys

import pytest

from doc_blocks import python_blocks, run_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
MARKDOWN = sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))
WITH_EXAMPLES = [p for p in MARKDOWN if python_blocks(p)]

# Blocks the test shows but does not run, at most this many in all docs (each needs a reason).
MAX_SKIPPED = 4


def _load(relpath: str):
    path = os.path.join(ROOT, relpath)
    name = "docs_" + os.path.splitext(os.path.basename(path))[0]
    if name not in sys.modules:     # registered before it runs: its dataclasses look it up
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


# ---- examples ----------------------------------------------------------------------------

@pytest.mark.parametrize("path", WITH_EXAMPLES, ids=[_rel(p) for p in WITH_EXAMPLES])
def test_doc_examples_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)             # examples that write files write them here
    run_blocks(python_blocks(path))


def test_few_skipped_examples_each_with_a_reason():
    skipped = [(b, b.skip_reason) for p in MARKDOWN for b in python_blocks(p) if b.skip_reason is not None]
    assert all(reason for _, reason in skipped), \
        [f"{_rel(b.path)}:{b.line}" for b, reason in skipped if not reason]
    assert len(skipped) <= MAX_SKIPPED, [f"{_rel(b.path)}:{b.line}: {r}" for b, r in skipped]


# ---- API reference -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def make_api():
    return _load("docs/make_api.py")


def test_api_md_lists_every_public_name(make_api):
    with open(make_api.OUTPUT) as f:
        committed = f.read()
    public = {e.qualname for e in make_api.entries()}
    documented = make_api.documented_names(committed)
    assert not public - documented, f"public but not in docs/api.md: {sorted(public - documented)}"
    assert not documented - public, f"in docs/api.md but gone: {sorted(documented - public)}"
    assert committed == make_api.render(), "docs/api.md is stale: run .venv/bin/python docs/make_api.py"


def test_public_names_have_docstrings(make_api):
    missing = sorted(make_api.missing_docs())
    assert not missing, f"public names without a docstring: {missing}"


# ---- reproductions -----------------------------------------------------------------------

def test_reproductions_md_is_current():
    make = _load("docs/make_reproductions.py")
    with open(make.OUTPUT) as f:
        assert f.read() == make.render(), \
            "docs/reproductions.md is stale: run .venv/bin/python docs/make_reproductions.py"


def test_validation_md_is_current():
    make = _load("docs/make_validation.py")
    with open(make.OUTPUT) as f:
        assert f.read() == make.render(), \
            "docs/validation.md is stale: run .venv/bin/python docs/make_validation.py"


# ---- figures -----------------------------------------------------------------------------

def test_figures_exist_and_are_the_generated_ones():
    linked = set()
    for path in MARKDOWN:
        with open(path) as f:
            for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", f.read()):
                full = os.path.normpath(os.path.join(os.path.dirname(path), target))
                assert os.path.exists(full), f"{_rel(path)} shows a missing image {target}"
                linked.add(full)
    make = _load("docs/figures/make_figures.py")
    pngs = set(glob.glob(os.path.join(DOCS, "figures", "*.png")))
    made = {os.path.join(DOCS, "figures", f"{name}.png") for name in make.FIGURES}
    assert pngs == made, f"docs/figures PNGs {sorted(map(_rel, pngs))} vs generated {sorted(map(_rel, made))}"
    assert made <= linked, f"figures no page shows: {sorted(map(_rel, made - linked))}"
    for png in pngs:
        assert os.path.getsize(png) < 300_000, f"{_rel(png)} is over 300 kB"


# ---- self-contained ----------------------------------------------------------------------

OUTSIDE = re.compile(r"(?i)\bissue\s*#?\d+|\bthe brief\b|brief\.md|\bseeds/|/work/shared")


def test_no_references_outside_the_repository():
    files = MARKDOWN + [os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "examples", "*"))
    files += glob.glob(os.path.join(ROOT, "pdjax", "**", "*.py"), recursive=True)
    bad = []
    for path in files:
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                bad += [f"{_rel(path)}: {m.group(0)!r}" for m in OUTSIDE.finditer(f.read())]
    assert not bad, bad
