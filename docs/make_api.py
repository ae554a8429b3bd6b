"""Write docs/api.md: every public name of pdjax with the summary line of its docstring.

    .venv/bin/python docs/make_api.py          # rewrite docs/api.md
    .venv/bin/python docs/make_api.py --check  # exit 1 if the file is stale

Public names: ``pdjax.__all__``, the public functions of ``pdjax.configs``, each
subpackage's ``__all__`` and, for ``pdjax.model`` (which exports modules), its ``MODULES``.
A function's, class's or module's summary is the first paragraph of its own docstring (a
class does not inherit one, and a dataclass's generated signature does not count); a
constant's is its ``#:`` comment, on the line(s) just above its assignment or at the end
of it, in the subpackage that defines it. tests/test_docs.py fails when docs/api.md and
this script's output differ, and when a public name has no summary.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import inspect
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUTPUT = os.path.join(HERE, "api.md")


@dataclasses.dataclass(frozen=True)
class Entry:
    module: str        # where the name is public: "pdjax", "pdjax.analysis", ...
    name: str
    kind: str          # "function", "class", "module" or the constant's type name
    signature: str     # "(a, b=1)" for functions, "" otherwise
    summary: str       # "" when there is none

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


def _first_paragraph(doc: str | None) -> str:
    if not doc or not doc.strip():
        return ""
    para = inspect.cleandoc(doc).split("\n\n")[0]
    para = re.sub(r":(?:func|class|meth|mod|attr|data):`~?([^`]+)`", r"`\1`", para)   # Sphinx roles
    para = re.sub(r"``([^`]+)``", r"`\1`", para)
    return " ".join(para.split())


def _own_doc(obj) -> str | None:
    """The object's own docstring: classes do not inherit one, and the signature a
    dataclass writes for itself is not documentation."""
    doc = obj.__doc__ if (inspect.isclass(obj) or inspect.ismodule(obj)) else inspect.getdoc(obj)
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc and doc.startswith(f"{obj.__name__}("):
        return None
    return doc


def _comment_doc(package: str, name: str) -> str:
    """The ``#:`` comment of constant ``name`` in the source of ``package``."""
    path = os.path.join(ROOT, *package.split("."))
    files = sorted(glob.glob(os.path.join(path, "*.py"))) if os.path.isdir(path) else [path + ".py"]
    # NAME = ..., NAME: type = ..., or NAME inside a tuple target (KB, MB, GB = ...)
    assign = re.compile(rf"^(?:\w+\s*,\s*)*{re.escape(name)}\s*(?:,\s*\w+\s*)*(?::[^=]*)?=(?!=)")
    for file in files:
        with open(file) as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            if not assign.match(line):
                continue
            same_line = re.search(r"#:\s*(.*)$", line)
            if same_line:
                return same_line.group(1).strip()
            above = []
            j = i - 1
            while j >= 0 and lines[j].lstrip().startswith("#:"):
                above.insert(0, lines[j].lstrip()[2:].strip())
                j -= 1
            if above:
                return " ".join(above)
    return ""


_SIMPLE = (type(None), bool, int, float, str)


def _default(value) -> str:
    if isinstance(value, _SIMPLE) and len(repr(value)) <= 30:
        return repr(value)
    if isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value) and len(repr(value)) <= 30:
        return repr(value)
    return "..."          # object reprs can hold addresses: keep the page deterministic


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parts, star_done = [], False
    for p in sig.parameters.values():
        if p.kind == p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind == p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star_done = True
        elif p.kind == p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={_default(p.default)}")
    return "(" + ", ".join(parts) + ")"


def _entry(module: str, name: str, obj, package: str) -> Entry:
    if inspect.ismodule(obj):
        return Entry(module, name, "module", "", _first_paragraph(_own_doc(obj)))
    if inspect.isclass(obj):
        return Entry(module, name, "class", "", _first_paragraph(_own_doc(obj)))
    if callable(obj) and (inspect.isroutine(obj) or hasattr(obj, "__wrapped__")):
        return Entry(module, name, "function", _signature(obj), _first_paragraph(_own_doc(obj)))
    return Entry(module, name, type(obj).__name__, "", _comment_doc(package, name))


def sections() -> list[tuple[str, str, list[Entry]]]:
    """[(module, its summary, its public entries in order)]."""
    import pdjax

    out = []
    top = [_entry("pdjax", n, getattr(pdjax, n), "pdjax") for n in pdjax.__all__]
    out.append(("pdjax", _first_paragraph(pdjax.__doc__), top))
    configs = pdjax.configs
    names = sorted(n for n, o in vars(configs).items()
                   if not n.startswith("_") and inspect.isfunction(o) and o.__module__ == configs.__name__)
    out.append(("pdjax.configs", _first_paragraph(configs.__doc__),
                [_entry("pdjax.configs", n, getattr(configs, n), "pdjax.configs") for n in names]))
    for sub in pdjax.SUBPACKAGES:
        mod = importlib.import_module(f"pdjax.{sub}")
        if hasattr(mod, "__all__"):
            names = list(mod.__all__)
            entries = [_entry(mod.__name__, n, getattr(mod, n), mod.__name__) for n in names]
        elif hasattr(mod, "MODULES"):       # pdjax.model: its public surface is its modules
            entries = [_entry(mod.__name__, n, importlib.import_module(f"{mod.__name__}.{n}"), mod.__name__)
                       for n in mod.MODULES]
        else:                               # pdjax.api: its functions are the top-level names
            continue
        out.append((mod.__name__, _first_paragraph(mod.__doc__), entries))
    return out


def entries() -> list[Entry]:
    return [e for _, _, es in sections() for e in es]


def missing_docs() -> list[str]:
    """Qualified public names without a summary."""
    return [e.qualname for e in entries() if not e.summary]


def _line(e: Entry) -> str:
    summary = e.summary or "*(no docstring)*"
    if e.kind == "function":
        return f"- `{e.name}{e.signature}`: {summary}"
    if e.kind in ("class", "module"):
        return f"- {e.kind} `{e.name}`: {summary}"
    return f"- `{e.name}` ({e.kind}): {summary}"


def render() -> str:
    secs = sections()
    out = ["# API reference", "",
           "Every public name of pdjax with the first paragraph of its docstring. Generated by",
           "`docs/make_api.py` from `pdjax.__all__`, `pdjax.configs`, each subpackage's `__all__` and",
           "the modules of `pdjax.model`; `tests/test_docs.py` fails when this page and the code",
           "disagree. `pdjax.api` holds the model functions re-exported at the top level",
           "(`forward`, `prefill`, `decode_step`, `generate`). Details, shapes and units are in the",
           "docstrings themselves (`help(pdjax.analysis.kv_bytes_per_token)`).", ""]
    out += [" · ".join(f"[`{m}`](#{m.replace('.', '')})" for m, _, _ in secs), ""]
    for module, summary, es in secs:
        out += [f"## {module}", "", summary, ""] if summary else [f"## {module}", ""]
        out += [_line(e) for e in es]
        out.append("")
    out += ["## Modules", "",
            "Each subpackage's face above is what a notebook starts with; everything else is importable",
            "from its module, listed here with the module's summary (`help(pdjax.analysis.kv)` for its names).", ""]
    out += [f"- `{name}`: {summary or '*(no docstring)*'}" for name, summary in modules()]
    out.append("")
    return "\n".join(out)


def modules() -> list[tuple[str, str]]:
    """[(dotted module name, the first paragraph of its docstring)] of every pdjax module."""
    import pkgutil

    import pdjax

    out = []
    for info in pkgutil.walk_packages(pdjax.__path__, "pdjax."):
        if info.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        out.append((info.name, _first_paragraph(importlib.import_module(info.name).__doc__)))
    return sorted(out)


def documented_names(text: str) -> set[str]:
    """Qualified names listed in an api.md text (for the drift test's messages)."""
    names, module = set(), None
    for line in text.splitlines():
        heading = re.match(r"^## (pdjax[\w.]*)\s*$", line)
        if heading or line.startswith("## "):
            module = heading.group(1) if heading else None
            continue
        item = re.match(r"^- (?:class |module )?`([A-Za-z_]\w*)", line)
        if item and module:
            names.add(f"{module}.{item.group(1)}")
    return names


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        with open(OUTPUT) as f:
            stale = f.read() != text
        print(f"{os.path.relpath(OUTPUT)} is {'stale: run docs/make_api.py' if stale else 'up to date'}")
        return int(stale)
    with open(OUTPUT, "w") as f:
        f.write(text)
    missing = missing_docs()
    print(f"wrote {os.path.relpath(OUTPUT)}" + (f"; no docstring: {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
