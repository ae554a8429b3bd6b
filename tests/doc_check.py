"""One snippet of the documentation checked: its pdjax names resolve and its calls of pdjax
callables bind (the rules are in tests/test_doc_calls.py's docstring)."""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import re
import types

from doc_refs import Snippet, import_aliases, statements
from doc_resolve import (DECLARED, UNKNOWN, Instance, Loose, Method, Missing, accepted_keywords, attribute, dotted,
                         function_of, lookup, owned, returned, signature, unloose)

FILE = re.compile(r"[\w./*<>{}-]+\.(py|md|csv|json|jsonl|png|txt|toml|yaml|npz|npy|html|svg|sh|log|safetensors)")


def qualified(obj) -> str:
    """``module.qualname`` of a pdjax object (a module: its name)."""
    obj = unloose(obj)
    if isinstance(obj, (Instance, Method)):
        return f"{obj.cls.__module__}.{obj.cls.__qualname__}" + (f".{obj.name}" if isinstance(obj, Method) else "")
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    return f"{obj.__module__}.{obj.__qualname__}"


class Checker:
    """Checks one snippet. Once ``run()``: its ``problems``; the number of pdjax ``names``
    resolved and of ``calls`` bound; and for running it: the names it reads that are bound
    nowhere (``free``), and the pdjax objects it uses (``uses``) and calls (``callees``)."""

    def __init__(self, snippet: Snippet):
        self.snippet, self.bound, self.cache = snippet, {}, {}
        self.problems, self.names, self.calls = [], 0, 0
        self.free, self.uses, self.callees = set(), set(), set()

    def run(self) -> Checker:
        kind = self.snippet.kind
        {"role": self.role, "span": self.span, "example": self.example}[kind]()
        return self

    def problem(self, message: str):
        if message not in self.problems:
            self.problems.append(message)

    # ---- values --------------------------------------------------------------------------

    def value(self, node: ast.expr):
        if id(node) not in self.cache:
            try:
                self.cache[id(node)] = self._value(node)
            except Missing as e:
                self.cache[id(node)] = e
        found = self.cache[id(node)]
        if isinstance(found, Missing):
            raise found
        if found is not UNKNOWN and owned(found):
            self.uses.add(qualified(found))
        return found

    def _value(self, node: ast.expr):
        if isinstance(node, ast.Name):
            found = self.bound[node.id] if node.id in self.bound else lookup(self.snippet.scope, node.id)
            if node.id not in self.bound and found is UNKNOWN and not hasattr(builtins, node.id):
                self.free.add(node.id)
            return UNKNOWN if found is DECLARED else found
        if isinstance(node, ast.Attribute):
            base = self.value(node.value)
            if base is UNKNOWN:
                return UNKNOWN
            try:
                return attribute(base, node.attr, ast.unparse(node))
            except Missing:
                path = self.module_path(node)        # pdjax.schedules.simulate.Timeline: the module
                if path is None:
                    raise
                return dotted(path, ast.unparse(node))
        if isinstance(node, ast.Call):
            return returned(self.value(node.func))
        return UNKNOWN

    def module_path(self, node: ast.Attribute) -> str | None:
        """``node`` as a dotted name from the pdjax module its root names (None: it is not
        one): documents mean the module where a package attribute shadows it."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.insert(0, node.attr)
            node = node.value
        root = self.value(node) if isinstance(node, ast.Name) else UNKNOWN
        if isinstance(root, types.ModuleType) and owned(root):
            return ".".join([root.__name__, *parts])
        return None

    # ---- statements ----------------------------------------------------------------------

    def statement(self, stmt: ast.stmt):
        aliases = import_aliases(stmt)
        for (alias, name), imported in zip(aliases, [a.name for a in getattr(stmt, "names", ())]):
            try:
                if isinstance(stmt, ast.Import) and imported.startswith("pdjax"):
                    dotted(imported, ast.unparse(stmt))          # import pdjax.a.b binds pdjax: a.b must exist
                self.bound[alias] = dotted(name, ast.unparse(stmt)) if name.startswith("pdjax") else UNKNOWN
                self.names += name.startswith("pdjax")
            except Missing as e:
                self.problem(str(e))
                self.bound[alias] = UNKNOWN
        if aliases:
            return
        chained = {id(n.value) for n in ast.walk(stmt) if isinstance(n, ast.Attribute)}
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                self.call(node)
            elif (isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load)
                  and id(node) not in chained):
                self.name(node)
        value = UNKNOWN
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            try:
                value = self.value(stmt.value)
            except Missing:
                pass
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.bound[node.id] = UNKNOWN
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.bound[node.name] = UNKNOWN
        if value is not UNKNOWN:
            self.bound[stmt.targets[0].id] = value

    def name(self, node: ast.expr):
        try:
            found = self.value(node)
        except Missing as e:
            self.problem(str(e))
            return
        self.names += found is not UNKNOWN and owned(found)

    def call(self, node: ast.Call):
        try:
            callee = self.value(node.func)
        except Missing as e:
            self.problem(str(e))
            return
        sig = None if callee is UNKNOWN else signature(callee)
        if sig is None:
            return
        elided = any(isinstance(a, ast.Starred) or (isinstance(a, ast.Constant) and a.value is Ellipsis)
                     for a in node.args)
        spread = any(k.arg is None for k in node.keywords)
        args, kwargs = [] if elided else [None] * len(node.args), {k.arg: None for k in node.keywords if k.arg}
        mention = not node.args                 # f() or f(k=...): names f (and its keyword k)
        self.calls += 1
        self.callees.add(qualified(callee))
        try:
            (sig.bind_partial if elided or spread or mention else sig.bind)(*args, **kwargs)
        except TypeError as e:
            self.problem(f"{ast.unparse(node)}: {e}; the signature is {ast.unparse(node.func)}{sig}")
            return
        passed_on = set(kwargs) - {p.name for p in sig.parameters.values()
                                   if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        accepted = accepted_keywords(function_of(callee)) if passed_on and not isinstance(callee, Loose) else None
        if accepted is not None and passed_on - accepted:
            self.problem(f"{ast.unparse(node)}: {sorted(passed_on - accepted)} reach no callable its **kwargs go to; "
                         f"the signature is {ast.unparse(node.func)}{sig}")

    # ---- kinds ---------------------------------------------------------------------------

    def role(self):
        target = self.snippet.text.split(":", 1)[1]
        target = re.sub(r"^.*<(.+)>$", r"\1", target).lstrip("~!.").removesuffix("()")
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", target):
            return
        root, *rest = target.split(".")
        try:
            obj = unloose(lookup(self.snippet.scope, root))
            if obj is UNKNOWN:
                if root != "pdjax" and importlib.util.find_spec(root) is not None:
                    return                  # another library's name (jax.vjp): not pdjax's to check
                raise Missing(f"{self.snippet.text}: {root!r} names nothing here")
            if isinstance(obj, types.ModuleType) and rest and owned(obj):
                dotted(".".join([obj.__name__, *rest]), self.snippet.text)
            for part in rest if not isinstance(obj, types.ModuleType) else ():
                known = obj is not UNKNOWN and obj is not DECLARED
                obj = attribute(obj, part, self.snippet.text) if known else UNKNOWN
            self.names += 1
        except Missing as e:
            self.problem(str(e))

    def span(self):
        code = " ".join(line.strip() for line in self.snippet.text.split("\n"))
        if FILE.fullmatch(code) or not re.search(r"[.(]", code):
            return                              # a file name; or no attribute, no call: nothing to check
        code = re.sub(r"(?<![=!<>\w])(\w+)=(?=\s*[,)])", r"\1=...", code)     # f(x=) means f(x=...)
        try:
            stmts = ast.parse(code).body
        except SyntaxError:
            for m in re.finditer(r"(?<![\w.])pdjax(?:\.\w+)+", code):
                try:
                    dotted(m.group(0), m.group(0))
                    self.names += 1
                except Missing as e:
                    self.problem(str(e))
            return
        for stmt in stmts:
            self.statement(stmt)

    def example(self):
        for stmt in statements(self.snippet.text):
            self.statement(stmt)


@functools.cache
def check(snippet: Snippet) -> Checker:
    return Checker(snippet).run()
