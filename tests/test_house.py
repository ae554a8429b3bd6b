"""The shape of the house (issue #24), read from the source with ``ast`` over all of pdjax:
module and function sizes, no import cycle, no import against the layering, the pure
subpackages loading neither jax nor the serving engines, and no test code in the library.

What is not reached yet is listed in ``LEFT`` below, each entry still checked: an entry
that no longer fails must be removed (the list only shrinks), and anything new fails."""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "pdjax"
TESTS = pathlib.Path(__file__).resolve().parent
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60

# The layering: model_config -> model -> parallel -> runtime / serving -> experiments; schedules,
# analysis and sim are pure Python. (importer prefix, forbidden import prefix)
FORBIDDEN = [
    *[(cfg, below) for cfg in ("pdjax.model_config", "pdjax.model_config_checks", "pdjax.configs")
      for below in ("pdjax.model", "pdjax.parallel", "pdjax.analysis")],
    ("pdjax.model", "pdjax.parallel"), ("pdjax.model", "pdjax.pipeline"), ("pdjax.model", "pdjax.disagg"),
    ("pdjax.model", "pdjax.experiments"), ("pdjax.parallel", "pdjax.pipeline"), ("pdjax.parallel", "pdjax.disagg"),
    ("pdjax.parallel", "pdjax.experiments"), ("pdjax.pipeline", "pdjax.disagg"),
    ("pdjax.pipeline", "pdjax.experiments"), ("pdjax.disagg", "pdjax.experiments"),
    ("pdjax.disagg", "pdjax.pipeline"),
    *[(pure, heavy) for pure in ("pdjax.schedules", "pdjax.analysis", "pdjax.sim")
      for heavy in ("jax", "pdjax.model", "pdjax.parallel", "pdjax.pipeline", "pdjax.disagg", "pdjax.experiments")],
    ("pdjax.schedules", "pdjax.sim"), ("pdjax.schedules", "pdjax.analysis"),
]
PURE = ("pdjax.schedules", "pdjax.analysis", "pdjax.sim")

# Not reached yet (issue #24); each entry must still fail, so the list only shrinks.
LEFT = {
    "size": set(),
    "layering": set(),
    "pure": set(),
}


def _modules() -> dict:
    """{dotted module name: path} of every pdjax module."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set:
    """Every module ``name`` imports (at any depth of the file): pdjax modules resolved to the
    longest module the import names; others by their top-level name. An import of the
    module's own package (its ``__init__`` re-exporting it) is not counted."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if not t.startswith("pdjax"):
                out.add(t.split(".")[0])
                continue
            while t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name and not name.startswith(t + "."):
                out.add(t)
    return out


@pytest.fixture(scope="module")
def graph() -> dict:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _ratchet(kind: str, found: set) -> None:
    new, fixed = found - LEFT[kind], LEFT[kind] - found
    assert not new, f"{kind}: new violations {sorted(new)}"
    assert not fixed, f"{kind}: no longer violated, remove from LEFT: {sorted(fixed)}"


def _is_declaration(node) -> bool:
    """A function whose body is one return of a literal table (tables aside)."""
    body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, (ast.Dict, ast.List))


def test_module_and_function_sizes():
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT.parent))
        src = path.read_text()
        if src.count("\n") > MAX_MODULE_LINES:
            found.add(rel)
        for node in ast.walk(ast.parse(src)):
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_declaration(node)
                    and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES):
                found.add(f"{rel}:{node.name}")
    _ratchet("size", found)


def test_no_import_cycle(graph):
    """Strongly connected components of the module import graph (Tarjan): none has two modules."""
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_no_import_against_the_layering(graph):
    found = set()
    for name, targets in graph.items():
        for t in targets:
            for importer, forbidden in FORBIDDEN:
                if (name == importer or name.startswith(importer + ".")) and \
                        (t == forbidden or t.startswith(forbidden + ".")):
                    found.add(f"{name} -> {t}")
    _ratchet("layering", found)


def test_pure_subpackages_load_no_jax_and_no_serving_engine():
    """In a fresh interpreter, importing each pure subpackage loads neither jax nor disagg."""
    code = ("import importlib, json, sys; out = {}\n"
            f"for m in {PURE!r}:\n"
            "    before = set(sys.modules); importlib.import_module(m)\n"
            "    out[m] = sorted(k for k in sys.modules if k in ('jax', 'jaxlib') or k.startswith('pdjax.disagg'))\n"
            "print(json.dumps(out))")
    # each in its own interpreter, so one cannot hide another's imports
    found = set()
    for m in PURE:
        run = subprocess.run([sys.executable, "-c", code.replace(repr(PURE), repr((m,)))], capture_output=True,
                             text=True, timeout=120, check=True)
        loaded = json.loads(run.stdout.strip().splitlines()[-1])[m]
        found |= {f"{m} -> {'jax' if k in ('jax', 'jaxlib') else 'pdjax.disagg'}" for k in loaded}
    _ratchet("pure", found)


def test_library_imports_nothing_from_tests(graph):
    test_modules = {p.stem for p in TESTS.rglob("*.py")} | {"tests"}
    used = {f"{name} -> {t}" for name, targets in graph.items() for t in targets if t in test_modules}
    assert not used, used


def test_no_two_modules_share_a_name():
    """A module's name says what it holds: no two pdjax modules (packages' __init__ aside) are
    called the same (there were three engine.py, three afd.py, two search.py, ...)."""
    by_name: dict = {}
    for path in ROOT.rglob("*.py"):
        if path.name != "__init__.py":
            by_name.setdefault(path.stem, []).append(str(path.relative_to(ROOT.parent)))
    assert not {k: v for k, v in by_name.items() if len(v) > 1}
