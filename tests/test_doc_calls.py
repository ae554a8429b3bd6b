"""Every documented call runs, or at least names what exists: the pdjax names and calls
written in docs/*.md, README.md and pdjax's docstrings resolve and bind to pdjax's
signatures. (The ```python blocks of docs/ and README.md run in test_docs.py and
test_readme.py; this checks the rest.)

What is read (doc_refs.py):

* the backtick spans of the Markdown prose and of every docstring (module, class, function)
  in pdjax/**/*.py; docs/api.md is left out (it is made from the docstrings, checked here at
  their source, and test_docs.py checks that it is current);
* the Python roles of the docstrings (:func:, :class:, :meth:, :mod:, :data:, :attr:, :exc:,
  :obj:; ``~target`` and ``title <target>`` too);
* examples: the Markdown's fenced blocks that are not ```python, and in docstrings the
  indented blocks after a blank or ``::`` line and ``>>>`` lines. Lines that do not parse as
  Python (shell commands, tables, formulas) are left out; a statement may span lines.

How names resolve (doc_resolve.py, doc_check.py):

* a dotted name: the longest importable module prefix, then attributes (so
  ``pdjax.schedules.simulate.Timeline`` is the module's, though the package's ``simulate``
  is the function); a class has its attributes, its fields and what its methods set on
  ``self``;
* a root: ``pdjax``; what the snippet imports or assigns (``ex = Executor(...)`` makes ``ex``
  an Executor, as does a function annotated to return one); in a Markdown file, the imports
  of its ```python blocks, then the names of the pdjax package it is named after
  (docs/pipeline.md: pdjax.pipeline), then the one object pdjax's ``__all__`` lists export
  under that name; in a docstring, the members of the class it documents (or of the
  method's class: relative roles like :meth:`step` resolve against the enclosing class),
  then its module's globals, then its module's package;
* a bare word that only that lookup makes a module or function (``cache``, ``run``) may be
  a variable or a method of the same name: a call of it is checked against the signature
  itself, its attributes are not. Anything not pdjax's (arguments, locals, numpy) is left
  unchecked.

What must hold:

* every role resolves (a root that names nothing in scope fails, unless it is another
  importable library);
* every name rooted in pdjax, or in a name bound to pdjax, resolves;
* every call of a pdjax callable binds: ``inspect.signature(f).bind`` with a placeholder
  per argument. ``f()`` and ``f(k=...)`` (no positional argument) mention ``f`` and its
  keywords, so only the keywords are checked (``bind_partial``), as in a call with an elided
  ``...`` positional (``f(..., k=v)``) or with ``*a`` / ``**kw``; ``f(k=)`` reads as
  ``f(k=...)``. A keyword the signature takes only through ``**kwargs`` must be taken by a
  pdjax callable those are passed to (followed through names of the function's module,
  ``super()`` and ``self``; one not known lets any keyword pass): ``prefix_cache=`` of
  ``pdjax.disagg.PDEngine(...)`` reaches the engine's options (a bare word's call: not
  followed). A span that does not parse has its ``pdjax.a.b`` names checked only; a span
  naming a file (``engine.py``) is skipped.

Running: a docstring example runs when it is self-contained and cheap: it parses whole,
reads no name it does not bind but builtins, ``pdjax`` and its module's globals, uses only
the pure-Python parts (``PURE``: no jax, no process, nothing compiled) and calls nothing in
``NOT_RUN``. It runs in a temporary directory, in a copy of its module's globals. The
Markdown's other fenced blocks are only checked (the ```python ones run in test_docs.py).

Problems in files others are editing are in ``KNOWN``, still checked: an entry that no
longer fails must be removed (the list only shrinks).
"""

import ast
import importlib
import os
import textwrap

import pytest

from doc_check import Checker, check
from doc_refs import MARKDOWN, MODULES, ROOT, Snippet, clean, example_blocks, rel, snippets

SOURCES = [p for p in MARKDOWN + MODULES if rel(p) != os.path.join("docs", "api.md") and snippets(p)]

PURE = ("pdjax.schedules", "pdjax.analysis", "pdjax.sim", "pdjax.configs", "pdjax.model_config")
NOT_RUN = {
    "pdjax.schedules.search.search": "a MILP schedule search: seconds",
    "pdjax.analysis.profile.read_profile": "reads a profiler trace the example does not have",
}

# (file, text of the problem) found in files being edited by others; each must still fail.
KNOWN: set = set()

# Floors on what the parser finds in all the sources, so that it cannot quietly stop reading.
MIN_NAMES, MIN_CALLS, MIN_EXAMPLES = 1250, 290, 15


def _known(path: str, problem: str) -> bool:
    return any(path == p and text in problem for p, text in KNOWN)


def _problems(path: str) -> list[str]:
    return [f"{s.where}: {m}" for s in snippets(path) for m in check(s).problems]


@pytest.mark.parametrize("path", SOURCES, ids=[rel(p) for p in SOURCES])
def test_documented_names_and_calls_resolve(path):
    bad = [m for m in _problems(path) if not _known(rel(path), m)]
    assert not bad, "\n".join(bad)


def test_known_problems_still_fail():
    fixed = [(path, text) for path, text in sorted(KNOWN)
             if not any(text in m for m in _problems(os.path.join(ROOT, path)))]
    assert not fixed, f"fixed: remove from KNOWN: {fixed}"


def _snippet(kind: str, text: str, scope=("md", "docs/pipeline.md")) -> Checker:
    return Checker(Snippet("synthetic", 1, kind, text, scope)).run()


@pytest.mark.parametrize("kind, text, scope", [
    ("span", 'pdjax.analysis.report(cfg, "h800", ep_sizes=32)', None),         # no such keyword
    ("span", "pdjax.disagg.launch_pd(num_decodes=2)", None),
    ("span", "pdjax.disagg.PDEngine(p, c, prefill_devices=..., decode_devices=..., prefix_caches=True)", None),
    ("span", "simulate(s, FF=1.0)", None),                                      # bare: pdjax.pipeline's
    ("span", "pdjax.analysis.kv_bytes_per_token(cfg, 2, 'mla', 1, 5)", None),  # too many positionals
    ("span", "pdjax.analysis.no_such_function", None),
    ("span", "pdjax.schedules.simulate.NoSuchClass", None),
    ("role", "func:pdjax.cluster.launch.no_such_function", ("py", "pdjax.cluster", "")),
    ("role", "meth:no_such_method", ("py", "pdjax.pipeline.executor", "Executor")),
    ("example", "import pdjax.no_such_module", None),
    ("example", "ex = pdjax.pipeline.Executor(s, cfg)\nex.stepp(params, tokens)", None),  # method of a result
    ("example", "pdjax launch -- python x.py\ns = build('1f1b', 2, 4, 8, 16)", None),  # module name, too many
])
def test_the_checker_finds_wrong_names_and_calls(kind, text, scope):
    assert _snippet(kind, text, scope or ("md", "docs/pipeline.md")).problems


@pytest.mark.parametrize("kind, text, scope", [
    ("span", 'pdjax.analysis.report(cfg, "h800", ep_size=32)', None),
    ("span", "launch_pd(num_decode=2)", None),                               # bare, via __all__
    ("span", "pdjax.disagg.PDEngine(p, c, prefill_devices=..., decode_devices=..., prefix_cache=True)", None),
    ("span", "pdjax.schedules.simulate.Timeline", None),
    ("span", "simulate(memory=...)", None),                                  # a mention of a keyword
    ("role", "meth:step", ("py", "pdjax.pipeline.executor", "Executor")),     # relative to the class
    ("role", "attr:replicated", ("py", "pdjax.pipeline.multiprocess", "Spanning")),   # set in __init__
    ("example", "ex = pdjax.pipeline.Executor(s, cfg)\nloss, grads = ex.step(params, tokens)", None),
])
def test_the_checker_passes_right_names_and_calls(kind, text, scope):
    checker = _snippet(kind, text, scope or ("md", "docs/pipeline.md"))
    assert not checker.problems and checker.names + checker.calls


def test_examples_in_docstrings_are_found():
    doc = clean('Summary.\n\n    x = pdjax.configs.tiny()\n        y = 1\n\n* a bullet\n  continued, not an example\n'
                '>>> pdjax.analysis.hardware("h800")\nHardwareSpec(...)\n')
    assert example_blocks(doc) == [(2, "x = pdjax.configs.tiny()\n    y = 1"), (7, 'pdjax.analysis.hardware("h800")')]


def test_the_parser_reads_the_docs():
    checkers = [check(s) for p in SOURCES for s in snippets(p)]
    names, calls = sum(c.names for c in checkers), sum(c.calls for c in checkers)
    examples = sum(1 for c in checkers if c.snippet.kind == "example" and c.names + c.calls)
    assert names >= MIN_NAMES and calls >= MIN_CALLS and examples >= MIN_EXAMPLES, (names, calls, examples)
    readme = [c for c in checkers if c.snippet.path == "README.md" and "launch_pd(num_decode=2)" in c.snippet.text]
    assert readme and all(c.calls for c in readme), "README's launch_pd call is not checked"


def runnable(checker: Checker) -> bool:
    """Whether an example runs here: see the module docstring."""
    s = checker.snippet
    if s.kind != "example" or s.scope[0] != "py" or checker.free or checker.problems:
        return False
    try:
        ast.parse(s.text)
    except SyntaxError:
        return False
    pdjax_uses = {u for u in checker.uses if u != "pdjax"}
    return (all(u.startswith(tuple(p + "." for p in PURE)) or u in PURE for u in pdjax_uses)
            and not checker.callees & NOT_RUN.keys()
            and bool(checker.calls))


def test_cheap_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    examples = [c.snippet for p in SOURCES if p.endswith(".py") for c in map(check, snippets(p)) if runnable(c)]
    assert {"pdjax/sim/__init__.py", "pdjax/analysis/deploy.py"} <= {s.path for s in examples}, examples
    for s in examples:
        tree = ast.parse(textwrap.dedent(s.text))
        ast.increment_lineno(tree, s.line - 1)
        namespace = dict(vars(importlib.import_module(s.scope[1])))
        namespace["pdjax"] = importlib.import_module("pdjax")
        exec(compile(tree, s.path, "exec"), namespace)      # noqa: S102 (pdjax's own example)
