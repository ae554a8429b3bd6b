"""``pdjax.compilation.disable_default_cache()`` turns the default persistent compilation
cache off in each documented order: called after ``import pdjax`` and before jax is
imported (the default then lives in the environment), after jax is imported, and in a child
process that inherited a parent's default. Each case runs in fresh processes, with a clean
environment (no cache directory of the user's), and compiles a program with no minimum
compile time: nothing may be written to the default directory."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPILE = "import jax, jax.numpy as jnp; jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()"
REPORT = "import jax; print(jax.config.jax_compilation_cache_dir)"
CASES = {
    "before jax": f"import pdjax; pdjax.compilation.disable_default_cache(); {REPORT}; {COMPILE}",
    "after jax": f"import pdjax, jax; pdjax.compilation.disable_default_cache(); {REPORT}; {COMPILE}",
    "in a child": ("import pdjax, subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', "
                   f"{'import pdjax; pdjax.compilation.disable_default_cache(); ' + REPORT + '; ' + COMPILE!r}]"
                   ").returncode)"),
    "opted out in a child": ("import os, pdjax, subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', "
                             f"{'import pdjax; ' + REPORT + '; ' + COMPILE!r}], "
                             "env={**os.environ, 'PDJAX_NO_COMPILATION_CACHE': '1'}).returncode)"),
    "left on (control)": f"import pdjax; {REPORT}; {COMPILE}",
}


def _run(code, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (
        "JAX_COMPILATION_CACHE_DIR", "PDJAX_NO_COMPILATION_CACHE", "PDJAX_DEFAULT_COMPILATION_CACHE_DIR")}
    env.update(XDG_CACHE_HOME=str(tmp_path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@pytest.mark.parametrize("case", CASES)
def test_disable_default_cache(case, tmp_path):
    default = tmp_path / "pdjax" / "jax"
    out = _run(CASES[case], tmp_path)
    written = sorted(p.name for p in default.rglob("*")) if default.exists() else []
    if case.startswith("left on"):          # the check can see a cache in use
        assert out == str(default) and written, (out, written)
    else:
        assert out == "None", f"{case}: jax's compilation cache dir is {out}"
        assert not written, f"{case}: the compile wrote {written} to {default}"
