"""Test set-up: 8 simulated CPU devices, XLA:CPU's LLVM back end at -O0 with its elemental
fusion emitter, and the persistent compilation cache (all set in the environment before jax
initialises, so child processes get them too), and float32 matmuls at full precision."""

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags = (flags + " --xla_force_host_platform_device_count=8").strip()
# The suite is compile-bound (tiny models, thousands of small programs): XLA:CPU's LLVM back end
# at -O0 compiles about a quarter faster (tests/parallel/test_ep.py 94 -> 68 s, fresh cache).
# XLA's own HLO passes (fusion, layout, simplification) still run, so the tests check the
# programs users run, short of LLVM's instruction-level optimisation; benchmarks and users keep
# the default level. Set XLA_FLAGS with another level to override.
if "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
# And XLA:CPU's older (elemental) fusion code generator instead of the MLIR fusion emitters:
# about 40 % less compile (tiny forward + prefill + decode + EP forward: 4.3 -> 2.6 s). Its
# fusion decisions differ a little (353 vs 413 fusions on a tiny decode + forward), so tests
# that measure the compiled program's traffic (tests/model/test_decode_traffic.py) compile in
# a child process with XLA's default flags.
if "xla_cpu_use_fusion_emitters" not in flags:
    flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = flags

# The persistent compilation cache, through the environment so that the child processes the
# tests start (two-process PD servers, pipeline rank processes) share it: a restarted server
# loads its programs instead of compiling them again.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                                                ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

import pdjax  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drop jax's compiled programs after each test module: every loaded XLA:CPU executable
    holds memory mappings, and the whole suite's would pass the kernel's per-process limit
    (vm.max_map_count, 65530 here; XLA then crashes in a compile)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_cfg():
    return pdjax.configs.tiny()


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    return pdjax.init_params(tiny_cfg, jax.random.key(0))


class CompileCounter:
    """Counts XLA compilations while active: ``with CompileCounter() as c: ...`` then
    ``c.count`` (a check that an error came before any compute)."""

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def _listen(self, name, secs, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


@pytest.fixture(scope="session")
def compile_counter():
    """:class:`CompileCounter`, for the tests of any directory."""
    return CompileCounter
