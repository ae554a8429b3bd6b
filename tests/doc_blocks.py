"""The ```python blocks of a Markdown file, run as written: in order, in one namespace.

Shared by tests/test_readme.py and tests/test_docs.py. A block whose first line starts with
``SKIP_MARKER`` (``# docs-test: skip: <reason>``) is shown to readers but not run; the
reason is required. Code is compiled under the Markdown file's name with its line numbers,
so a failing example's traceback points at the line in the document.
"""

from __future__ import annotations

import dataclasses
import re

SKIP_MARKER = "# docs-test: skip"


@dataclasses.dataclass(frozen=True)
class Block:
    path: str
    line: int          # line of the block's first code line in the file (1-based)
    code: str

    @property
    def skip_reason(self) -> str | None:
        """None when the block runs; else the reason given after the marker ("" if none)."""
        first = self.code.split("\n", 1)[0].strip()
        if not first.startswith(SKIP_MARKER):
            return None
        return first[len(SKIP_MARKER):].lstrip(":").strip()


def python_blocks(path: str) -> list[Block]:
    with open(path) as f:
        text = f.read()
    return [Block(path, text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def run_blocks(blocks: list[Block], namespace: dict | None = None) -> dict:
    """Execute the blocks that are not skipped, in order, in ``namespace``; returns it."""
    namespace = {"__name__": "__main__"} if namespace is None else namespace
    for block in blocks:
        if block.skip_reason is not None:
            continue
        code = "\n" * (block.line - 1) + block.code
        exec(compile(code, block.path, "exec"), namespace)
    return namespace
