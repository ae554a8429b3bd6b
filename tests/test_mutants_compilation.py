"""The documented defaults of :mod:`pdjax.compilation` that its other tests leave unpinned: the
progress line's delay and its ``PDJAX_COMPILE_PROGRESS`` switch (read at import), the cache
directory without ``XDG_CACHE_HOME``, and ``enable_default_cache``'s None when the user chose a
directory. Found by mutation testing (docs/mutation.md)."""

import os
import pathlib
import subprocess
import sys

from pdjax import compilation

ROOT = pathlib.Path(__file__).resolve().parent.parent
REPORT = ("import pdjax, pdjax.compilation as c; "
          "print(repr(c.progress_after_s), repr(c.enable_default_cache()), repr(c._set_by_us))")


def _report(tmp_path, **env):
    clean = {k: v for k, v in os.environ.items() if k not in (
        "JAX_COMPILATION_CACHE_DIR", "PDJAX_NO_COMPILATION_CACHE", "PDJAX_DEFAULT_COMPILATION_CACHE_DIR",
        "PDJAX_COMPILE_PROGRESS")}
    clean.update(env, XDG_CACHE_HOME=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", REPORT], env=clean, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_progress_delay_and_its_switch_and_the_users_directory(tmp_path):
    """The progress line waits 1.5 s by default and ``PDJAX_COMPILE_PROGRESS=0`` (only "0")
    turns it off at import; ``PDJAX_NO_COMPILATION_CACHE=0`` does not opt out; with the
    user's ``JAX_COMPILATION_CACHE_DIR`` pdjax chose no directory and
    ``enable_default_cache()`` returns None."""
    default = repr(str(tmp_path / "pdjax" / "jax"))
    assert _report(tmp_path) == ["1.5", default, default]
    assert _report(tmp_path, PDJAX_COMPILE_PROGRESS="0")[0] == "None"
    assert _report(tmp_path, PDJAX_COMPILE_PROGRESS="1")[0] == "1.5"
    assert _report(tmp_path, PDJAX_NO_COMPILATION_CACHE="0") == ["1.5", default, default]
    assert _report(tmp_path, JAX_COMPILATION_CACHE_DIR="/somewhere/mine") == ["1.5", "None", "None"]


def test_default_cache_dir_without_xdg_cache_home(monkeypatch, tmp_path):
    """Without ``XDG_CACHE_HOME`` (or with it empty) the default directory is
    ``~/.cache/pdjax/jax``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert compilation.default_cache_dir() == str(tmp_path / ".cache" / "pdjax" / "jax")
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert compilation.default_cache_dir() == str(tmp_path / ".cache" / "pdjax" / "jax")


def test_after_disabling_the_users_directory_is_not_taken_for_pdjaxs(monkeypatch, tmp_path):
    """``disable_default_cache`` removes pdjax's default from the environment and forgets it:
    a directory the user sets afterwards is the user's, and ``enable_default_cache()``
    returns None for it."""
    mine = str(tmp_path / "pdjax" / "jax")
    monkeypatch.setattr(compilation, "_set_by_us", mine)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", mine)
    monkeypatch.setenv("PDJAX_DEFAULT_COMPILATION_CACHE_DIR", mine)
    compilation.disable_default_cache()
    assert "JAX_COMPILATION_CACHE_DIR" not in os.environ
    assert "PDJAX_DEFAULT_COMPILATION_CACHE_DIR" not in os.environ
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere/mine")
    assert compilation.enable_default_cache() is None


def test_a_slow_compile_without_a_note_prints_its_duration_alone(monkeypatch, capsys):
    """A compile past ``progress_after_s`` without a ``done`` note prints exactly
    ``pdjax: compiling <what>... <seconds> s`` (the seconds it took) and a newline, on the
    given stream, else on stderr."""
    import io
    import re
    import time

    monkeypatch.setattr(compilation, "progress_after_s", 0.05)
    out = io.StringIO()
    with compilation.announce("zb1p", stream=out):
        time.sleep(0.3)
    line = re.fullmatch(r"pdjax: compiling zb1p\.\.\. (\d+\.\d) s\n", out.getvalue())
    assert line and 0.2 <= float(line[1]) < 60, out.getvalue()       # the compile's duration
    with compilation.announce("dualpipe"):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert re.fullmatch(r"pdjax: compiling dualpipe\.\.\. \d+\.\d s\n", err), err


def test_the_progress_line_is_flushed_while_compiling_and_at_the_end(monkeypatch):
    """On a buffered stream the progress line is visible while the compile is still running
    (the first part is flushed though it ends no line), and the whole line once it ends."""
    import io
    import re
    import time

    monkeypatch.setattr(compilation, "progress_after_s", 0.05)
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="utf-8")          # fully buffered, not line-buffered
    with compilation.announce("zbv", stream=stream):
        time.sleep(0.3)
        assert raw.getvalue() == b"pdjax: compiling zbv..."
    assert re.fullmatch(rb"pdjax: compiling zbv\.\.\. \d+\.\d s\n", raw.getvalue()), raw.getvalue()
