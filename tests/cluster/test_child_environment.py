"""Every process pdjax starts gets this process's jax settings (matmul precision, compilation
cache) from the one function that defines them, through ``device_environ``: the
``pdjax launch`` workers, the PD servers, the FFN process, the pipeline's processes. Each
start path is run up to the point where it starts its first child, which is recorded and
refused (nothing is started)."""

import jax
import pytest

import pdjax
from pdjax.cluster import supervisor
from pdjax.cluster.supervisor import JAX_SETTINGS


class _Started(Exception):
    pass


@pytest.fixture
def started(monkeypatch):
    """The environments of the children the code under test starts (the first refused)."""
    envs = []

    def start(self, argv, env=None, **kw):
        envs.append(env)
        raise _Started(argv)
    monkeypatch.setattr(supervisor.Supervisor, "start", start)
    old = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")   # a setting a child must not lose
    yield envs
    jax.config.update("jax_default_matmul_precision", old)


STARTS = {
    "launch": lambda: pdjax.cluster.launch(["true"], 2, 1),
    "launch_pd": lambda: pdjax.disagg.launch_pd("tiny", 0),
    "launch_ffn": lambda: pdjax.disagg.launch_ffn("tiny", 0),
}


@pytest.mark.parametrize("name", sorted(STARTS))
def test_every_process_pdjax_starts_gets_this_processs_jax_settings(name, started):
    with pytest.raises(_Started):
        STARTS[name]()
    assert len(started) == 1 and started[0] is not None
    want = {n.upper(): str(getattr(jax.config, n)) for n in JAX_SETTINGS if getattr(jax.config, n) is not None}
    assert want["JAX_DEFAULT_MATMUL_PRECISION"] == "highest"
    assert {k: started[0].get(k) for k in want} == want
