"""docs/architecture.md stays true: every `pdjax...` name and every repository path it
cites in backticks exists (modules are imported, the rest looked up attribute by
attribute)."""

import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


def _cited(text: str) -> tuple[set, set]:
    """(dotted pdjax names, repository paths) in inline backticks (code blocks aside)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", prose)
    names = {s.rstrip("()") for s in spans if re.fullmatch(r"pdjax(\.[A-Za-z_]\w*)*(\(\))?", s)}
    paths = {s for s in spans if "/" in s and re.fullmatch(r"[\w./]+\.(py|toml|md)", s)}
    return names, paths


def _resolve(name: str):
    """The object ``name`` names: its longest importable module prefix, then attributes."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ModuleNotFoundError:
            continue
        for attr in parts[n:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_every_cited_module_and_name_exists():
    names, paths = _cited(DOC.read_text())
    assert len(names) > 40 and paths        # the page cites the flows' modules and names
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {type(e).__name__}: {e}")
    missing += [p for p in sorted(paths) if not (ROOT / p).exists()]
    assert not missing, missing


def test_the_named_steps_are_called_in_the_flows_they_describe():
    """The page's flows follow the code: the modules each flow names are the ones it enters
    (checked on the experiment flow, which runs in a second)."""
    import sys

    from pdjax.experiments import cli

    text = DOC.read_text()
    section = text[text.index("## An experiment TOML"):]
    cited = {n.rsplit(".", 1)[0] for n in _cited(section)[0] if n.count(".") >= 3}
    entered = set()

    def prof(frame, event, arg):
        if event == "call":
            entered.add(frame.f_globals.get("__name__", ""))
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        sys.setprofile(prof)
        try:
            cli.main(["run", "bubble_sweep", "--quiet", "--runs-dir", d, "--set", "sweep.num_stages=[4]",
                      "--set", "sweep.microbatch_multipliers=[1]"])
        finally:
            sys.setprofile(None)
    assert cited and cited <= entered, sorted(cited - entered)
