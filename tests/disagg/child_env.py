"""The environment of the serving processes the cluster tests start: they compute as the test
process does (tests/conftest.py sets the matmul precision) and share its compilation cache."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD_ENV = {"JAX_DEFAULT_MATMUL_PRECISION": "highest",
             "JAX_COMPILATION_CACHE_DIR": os.path.join(ROOT, ".jax_cache"),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
