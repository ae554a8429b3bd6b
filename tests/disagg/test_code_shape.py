"""The serving core stays readable (issue #12): no module of pdjax/disagg over 400 lines, no
function over 60."""

import ast
import pathlib

import pdjax.disagg

ROOT = pathlib.Path(pdjax.disagg.__file__).parent


def test_no_long_modules_or_functions():
    long = []
    for path in sorted(ROOT.glob("*.py")):
        src = path.read_text()
        if src.count("\n") > 400:
            long.append(f"{path.name}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long
