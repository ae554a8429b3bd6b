"""The key-value store of a ``jax.distributed`` cluster (served by the coordinator): small
strings every process can set and wait for, e.g. "this value is ready to pull".

jax keeps the client private (``jax._src.distributed.global_state``); this module is the one
place pdjax reaches it."""

from __future__ import annotations


def _client():
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized in this process (call pdjax.cluster.initialize() "
                           "first)")
    return global_state.client


def put(key: str, value: str) -> None:
    """Set ``key`` (once: a key is written by one process)."""
    _client().key_value_set(key, value)


def get(key: str, timeout_s: float) -> str:
    """The value of ``key``, waiting up to ``timeout_s`` seconds for a process to set it;
    TimeoutError naming the key after that."""
    import jax

    try:
        return _client().blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
    except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
            raise TimeoutError(f"no process set {key!r} within {timeout_s:g} s") from None
        raise


def delete(key: str) -> None:
    _client().key_value_delete(key)


def keys(prefix: str) -> list[str]:
    """The keys set under ``prefix`` (a directory: ``prefix`` ends with ``/``), sorted."""
    return sorted(k for k, _ in _client().key_value_dir_get(prefix))


def barrier(name: str, timeout_s: float) -> None:
    """Wait until every process of the cluster reached the barrier ``name`` (each name once),
    up to ``timeout_s`` seconds (TimeoutError). The coordinator holds it: no device runs a
    collective for it, so a device busy serving a transfer is not waited for."""
    import jax

    try:
        _client().wait_at_barrier(name, max(1, int(timeout_s * 1000)))
    except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
            raise TimeoutError(f"not every process reached barrier {name!r} within {timeout_s:g} s") from None
        raise
