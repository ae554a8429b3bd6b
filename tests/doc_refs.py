"""What the documentation names and calls, found in docs/*.md, README.md and pdjax's
docstrings: the snippets tests/test_doc_calls.py checks (that module states the rules;
doc_resolve.py and doc_check.py resolve and check them).

A ``Snippet`` is one Python role (``:func:`x```), one backtick span, or one example block,
with the file and line it starts on and the scope its bare names resolve in: a Markdown
file, or a pdjax module and the class the docstring belongs to.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import os
import re
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKDOWN = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)) + [
    os.path.join(ROOT, "README.md")]
MODULES = sorted(p for p in glob.glob(os.path.join(ROOT, "pdjax", "**", "*.py"), recursive=True)
                 if not p.endswith("__main__.py"))          # importing it runs the command line

PY_ROLES = {"func", "meth", "class", "mod", "data", "attr", "exc", "obj"}
ROLE = re.compile(r":(?:py:)?(\w+):`([^`\n]+)`")
# inline code: matching runs of backticks, never across a paragraph break
SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)
FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Snippet:
    path: str          # relative to the repository root
    line: int          # the line it starts on (1-based)
    kind: str          # "role", "span" or "example"
    text: str          # role: "func:target"; span: its code; example: the dedented block
    scope: tuple       # ("md", relpath) or ("py", module name, class qualname or "")

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def module_name(path: str) -> str:
    parts = os.path.splitext(rel(path))[0].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def text_snippets(path: str, text: str, first_line: int, scope: tuple) -> list[Snippet]:
    """The roles and backtick spans of ``text`` (roles first taken out of the text)."""
    out = []

    def role(m):
        if m.group(1) in PY_ROLES:
            out.append(Snippet(path, first_line + text.count("\n", 0, m.start()), "role",
                               f"{m.group(1)}:{m.group(2)}", scope))
        return " " * len(m.group(0))

    rest = ROLE.sub(role, text)
    for m in SPAN.finditer(rest):
        out.append(Snippet(path, first_line + rest.count("\n", 0, m.start()), "span", m.group(2), scope))
    return out


def markdown_snippets(path: str) -> list[Snippet]:
    """Spans of the prose, and the fenced blocks that are not ```python (tests/test_docs.py
    runs those) as examples."""
    with open(path) as f:
        text = f.read()
    path, scope = rel(path), ("md", rel(path))
    out = [Snippet(path, text.count("\n", 0, m.start(2)) + 1, "example", m.group(2), scope)
           for m in FENCE.finditer(text) if m.group(1) != "python"]
    prose = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return out + text_snippets(path, prose, 1, scope)


def clean(doc: str) -> str:
    """``inspect.cleandoc`` that keeps every line (so line numbers stay the file's)."""
    first, _, rest = doc.partition("\n")
    return first.strip() + ("\n" + textwrap.dedent(rest) if rest else "")


def example_blocks(doc: str) -> list[tuple[int, str]]:
    """(line offset, dedented code) of the docstring's examples: indented blocks after a
    blank line or a ``::`` line, and runs of ``>>>`` lines (prompts taken off, output left
    out)."""
    lines, out, i = doc.split("\n"), [], 0
    while i < len(lines):
        if lines[i].lstrip().startswith(">>> "):
            j = i + 1
            while j < len(lines) and lines[j].lstrip().startswith("... "):
                j += 1
            out.append((i, "\n".join(line.lstrip()[4:] for line in lines[i:j])))
        elif lines[i].startswith(" ") and i and (not lines[i - 1].strip() or lines[i - 1].rstrip().endswith("::")):
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                j += 1
            if not any(line.lstrip().startswith(">>> ") for line in lines[i:j]):
                out.append((i, textwrap.dedent("\n".join(lines[i:j])).strip("\n")))
                i = j - 1
        i += 1
    return out


def _docstrings(tree: ast.Module):
    """(node, class qualname) of every node that can hold a docstring; the class of a class
    docstring is the class itself, of a method its class."""
    def walk(node, cls):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                own = f"{cls}.{child.name}" if cls else child.name
                yield child, own
                yield from walk(child, own)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield child, cls
                yield from walk(child, cls)
    yield tree, ""
    yield from walk(tree, "")


def docstring_snippets(path: str) -> list[Snippet]:
    with open(path) as f:
        tree = ast.parse(f.read())
    out, module = [], module_name(path)
    for node, cls in _docstrings(tree):
        body = node.body
        if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            continue
        doc, line, scope = clean(body[0].value.value), body[0].lineno, ("py", module, cls)
        out += text_snippets(rel(path), doc, line, scope)
        out += [Snippet(rel(path), line + offset, "example", code, scope) for offset, code in example_blocks(doc)]
    return out


@functools.cache
def snippets(path: str) -> tuple[Snippet, ...]:
    return tuple(markdown_snippets(path) if path.endswith(".md") else docstring_snippets(path))


@functools.cache
def markdown_imports(relpath: str) -> tuple[tuple[str, str], ...]:
    """(alias, dotted pdjax name) of the imports in a Markdown file's ```python blocks: the
    names its prose may use (``A`` after ``import pdjax.analysis as A``)."""
    with open(os.path.join(ROOT, relpath)) as f:
        text = f.read()
    out = []
    for m in FENCE.finditer(text):
        for stmt in statements(m.group(2)):
            out += [(alias, name) for alias, name in import_aliases(stmt) if name.startswith("pdjax")]
    return tuple(out)


def import_aliases(stmt: ast.stmt) -> list[tuple[str, str]]:
    """(bound name, dotted name it stands for) of an import statement (else [])."""
    if isinstance(stmt, ast.Import):
        return [(a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0])
                for a in stmt.names]
    if isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
        return [(a.asname or a.name, f"{stmt.module}.{a.name}") for a in stmt.names if a.name != "*"]
    return []


def statements(code: str) -> list[ast.stmt]:
    """The statements of ``code`` that parse: each shortest run of lines that parses (so a
    statement may span lines), lines that start none (shell commands, formulas) left out."""
    lines, out, i = textwrap.dedent(code).split("\n"), [], 0
    while i < len(lines):
        for j in range(i + 1, len(lines) + 1):
            try:
                tree = ast.parse(textwrap.dedent("\n".join(lines[i:j])))
            except SyntaxError:
                continue
            out += tree.body
            i = j
            break
        else:
            i += 1
    return out


@functools.cache
def public_index() -> dict:
    """{name: (modules whose ``__all__`` lists it)}, read from the source without importing."""
    index = {}
    for path in MODULES:
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Tuple))
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
                for elt in node.value.elts:
                    if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                        index.setdefault(elt.value, []).append(module_name(path))
    return {name: tuple(mods) for name, mods in index.items()}
