"""Names of the documentation resolved against pdjax, for doc_check.py (the rules are in
tests/test_doc_calls.py's docstring).

A value the checker cannot know (a local variable, an argument, anything outside pdjax) is
``UNKNOWN`` and everything built on it is left unchecked; a name rooted in pdjax that does
not resolve raises ``Missing``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import sys
import textwrap
import types

from doc_refs import markdown_imports, public_index

UNKNOWN = object()
DECLARED = object()         # a member a class declares (a field, a self.<name>) whose value is not known


class Missing(Exception):
    """A name rooted in pdjax that does not resolve."""


@dataclasses.dataclass(frozen=True)
class Instance:
    """An object of a pdjax class (what calling the class, or a function annotated to
    return it, gives)."""
    cls: type


@dataclasses.dataclass(frozen=True)
class Method:
    """A method looked up on an ``Instance``: called without its first parameter."""
    cls: type
    name: str


@dataclasses.dataclass(frozen=True)
class Loose:
    """A module or function a bare word happens to name (``cache``, ``run``): it may be a
    variable or a method of the same name, so its attributes are not checked, and a call of
    it only against its own signature."""
    obj: object


def unloose(obj):
    return obj.obj if isinstance(obj, Loose) else obj


def owned(obj) -> bool:
    """Whether ``obj`` is pdjax's own (a module, class or function of it)."""
    if isinstance(obj, (Instance, Method, Loose)):
        return owned(unloose(obj)) if isinstance(obj, Loose) else True
    if isinstance(obj, types.ModuleType):
        return obj.__name__.split(".")[0] == "pdjax"
    if isinstance(obj, (type, types.FunctionType, types.MethodType)):
        return (getattr(obj, "__module__", None) or "").split(".")[0] == "pdjax"
    return False


@functools.cache
def _self_attributes(path: str) -> dict:
    """{class qualname: names its methods assign as ``self.<name>``} of one source file."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = {}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                out[name] = frozenset(n.attr for n in ast.walk(child) if isinstance(n, ast.Attribute)
                                      and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                                      and n.value.id == "self")
                walk(child, name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child, f"{prefix}{child.name}.<locals>.")
    walk(tree, "")
    return out


def has_attribute(cls: type, name: str, dynamic: bool = True) -> bool:
    """Whether instances of ``cls`` have ``name``: a class attribute, a field (dataclass,
    NamedTuple, annotation, slot), an attribute its methods set on ``self``, or (``dynamic``)
    any name when the class defines ``__getattr__``."""
    if hasattr(cls, name) or (dynamic and hasattr(cls, "__getattr__")):
        return True
    for base in cls.__mro__:
        if name in getattr(base, "__annotations__", {}) or name in getattr(base, "__slots__", ()):
            return True
        path = getattr(sys.modules.get(base.__module__), "__file__", None) if owned(base) else None
        if path and name in _self_attributes(path).get(base.__qualname__, ()):
            return True
    return False


def signature(callee) -> inspect.Signature | None:
    """The signature a call of ``callee`` binds to (None: not a pdjax callable, or none)."""
    callee = unloose(callee)
    try:
        if isinstance(callee, Instance):
            if not any("__call__" in vars(base) for base in callee.cls.__mro__[:-1]):
                return None
            callee = Method(callee.cls, "__call__")
        if isinstance(callee, Method):
            sig = inspect.signature(getattr(callee.cls, callee.name))
            if isinstance(inspect.getattr_static(callee.cls, callee.name), (staticmethod, classmethod)):
                return sig
            return sig.replace(parameters=list(sig.parameters.values())[1:])
        if owned(callee) and callable(callee) and not isinstance(callee, types.ModuleType):
            return inspect.signature(callee)
    except (TypeError, ValueError, AttributeError):
        pass
    return None


def function_of(callee):
    """The Python function a call of ``callee`` runs (a class: its ``__init__``)."""
    callee = unloose(callee)
    if isinstance(callee, Instance):
        callee = Method(callee.cls, "__call__")
    func = getattr(callee.cls, callee.name, None) if isinstance(callee, Method) else callee
    func = func.__init__ if isinstance(func, type) else func
    return getattr(func, "__func__", func)


def _owner(func) -> type | None:
    """The class a method is defined in (None: not a method, or a local one)."""
    *outer, _ = func.__qualname__.split(".")
    obj = sys.modules.get(func.__module__)
    for part in outer:
        obj = getattr(obj, part, None)
    return obj if outer and isinstance(obj, type) else None


def _forward_target(node: ast.expr, func):
    """The pdjax callable ``func`` calls as ``node``: a (dotted) name of its module,
    ``super().name`` or ``self.name``; None when not known."""
    cls = _owner(func)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call) and cls \
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "super":
        return next((Method(base, node.attr) for base in cls.__mro__[1:] if node.attr in vars(base)), None)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" and cls:
        return Method(cls, node.attr) if hasattr(cls, node.attr) else None
    parts = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    obj = func.__globals__.get(node.id) if isinstance(node, ast.Name) else None
    for part in parts:
        obj = getattr(obj, part, None)
    return obj if owned(obj) else None


_FOLLOWING = set()      # the functions accepted_keywords is following now (a recursive call: no news)


@functools.cache
def accepted_keywords(func) -> frozenset | None:
    """The keywords a call of ``func`` accepts, its ``**kwargs`` followed into the pdjax
    callables it passes them to (None: any, as far as can be told)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return None
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    spread = [p.name for p in params if p.kind is p.VAR_KEYWORD]
    if not spread:
        return frozenset(named)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return None
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and any(
        k.arg is None and isinstance(k.value, ast.Name) and k.value.id == spread[0] for k in c.keywords)]
    accepted = set(named)
    _FOLLOWING.add(func)
    try:
        for call in calls:
            target = function_of(_forward_target(call.func, func))
            more = frozenset() if target in _FOLLOWING else accepted_keywords(target) if target else None
            if more is None:
                return None
            accepted |= more - {k.arg for k in call.keywords if k.arg}
    finally:
        _FOLLOWING.discard(func)
    return frozenset(accepted) if calls else None


def returned(callee):
    """What calling ``callee`` gives, as far as known: an ``Instance`` of a pdjax class, from
    the class itself or the function's return annotation; else ``UNKNOWN``."""
    callee = unloose(callee)
    if isinstance(callee, type) and owned(callee):
        return Instance(callee)
    func = {Instance: lambda c: getattr(c.cls, "__call__", None),
            Method: lambda c: getattr(c.cls, c.name, None)}.get(type(callee), lambda c: c)(callee)
    if not owned(func) or isinstance(func, (type, types.ModuleType)):
        return UNKNOWN
    annotation = inspect.signature(func).return_annotation
    if isinstance(annotation, str):
        try:
            annotation = eval(annotation, getattr(func, "__globals__", {}))   # noqa: S307 (pdjax's own annotation)
        except Exception:
            return UNKNOWN
    return Instance(annotation) if isinstance(annotation, type) and owned(annotation) else UNKNOWN


def attribute(base, name: str, text: str):
    """``base.name``; raises Missing when pdjax's ``base`` has no ``name``."""
    if isinstance(base, Instance):
        if not has_attribute(base.cls, name):
            raise Missing(f"{text}: {base.cls.__qualname__} objects have no attribute {name!r}")
        static = inspect.getattr_static(base.cls, name, None)
        is_method = isinstance(static, (types.FunctionType, staticmethod, classmethod))
        return Method(base.cls, name) if is_method else UNKNOWN
    if not owned(base) or isinstance(base, (Method, Loose)):
        return UNKNOWN
    if isinstance(base, types.ModuleType):
        try:
            return getattr(base, name)
        except AttributeError:
            try:
                return importlib.import_module(f"{base.__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{base.__name__}.{name}":
                    raise
                raise Missing(f"{text}: module {base.__name__} has no {name!r}") from None
    if hasattr(base, name):
        return getattr(base, name)
    if isinstance(base, type) and has_attribute(base, name):
        return UNKNOWN
    raise Missing(f"{text}: {getattr(base, '__qualname__', base)!r} has no attribute {name!r}")


def dotted(name: str, text: str):
    """The object a dotted pdjax name names: the longest importable module prefix, then
    attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if not ".".join(parts[:i]).startswith(e.name or "\0"):
                raise
            continue
        for part in parts[i:]:
            obj = attribute(obj, part, text)
        return obj
    raise Missing(f"{text}: no module {parts[0]}")


def _in_markdown(relpath: str, name: str):
    """A bare name in a Markdown file: one its ```python blocks import, one of the pdjax
    package the file is named after (docs/pipeline.md: pdjax.pipeline), or the one object
    that every pdjax ``__all__`` listing the name exports."""
    aliases = dict(markdown_imports(relpath))
    if name in aliases:
        return dotted(aliases[name], name)
    stem = relpath.rsplit("/", 1)[-1].removesuffix(".md")
    if stem.isidentifier():
        try:
            return _loose(attribute(dotted(f"pdjax.{stem}", name), name, name))
        except Missing:
            pass
    found = {id(obj): obj for obj in (getattr(importlib.import_module(m), name, UNKNOWN)
                                      for m in public_index().get(name, ())) if obj is not UNKNOWN}
    return _loose(next(iter(found.values()))) if len(found) == 1 else UNKNOWN


def _loose(obj):
    return Loose(obj) if isinstance(obj, (types.ModuleType, types.FunctionType)) else obj


def _in_module(module: str, qualname: str, name: str):
    """A bare name in a docstring: a member of the class it documents (or of the method's
    class), else a global of its module, else a name of its package (a package's own
    docstring: of itself)."""
    mod = importlib.import_module(module)
    cls = mod
    for part in filter(None, qualname.split(".")):
        cls = getattr(cls, part, None)
    if isinstance(cls, type) and has_attribute(cls, name, dynamic=False):
        static = inspect.getattr_static(cls, name, None)
        if isinstance(static, types.FunctionType):
            return Method(cls, name)
        return getattr(cls, name, DECLARED)
    if name in vars(mod):
        return _loose(vars(mod)[name])
    package = mod if hasattr(mod, "__path__") else sys.modules.get(module.rpartition(".")[0])
    if package is not None and not name.startswith("_"):
        try:                                # a lazy attribute, a submodule, a sibling module
            return _loose(attribute(package, name, name))
        except Missing:
            pass
    return UNKNOWN


@functools.cache
def lookup(scope: tuple, name: str):
    """What a bare name of a snippet with ``scope`` stands for (``UNKNOWN``: not known)."""
    if name == "pdjax":
        return importlib.import_module("pdjax")
    return _in_markdown(scope[1], name) if scope[0] == "md" else _in_module(scope[1], scope[2], name)
