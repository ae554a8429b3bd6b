"""One compiled program, loaded on other devices.

The executor runs the same stage program on several ranks (DualPipe's two copies of every
chunk, an interleaved schedule's chunks of one shape, a searched schedule's stages): the
programs differ only by the devices they run on. jax compiles a program for one device
assignment, and a compiled single-device program refuses buffers on another device, so each
copy used to pay a full XLA compile. :func:`relocate` loads the compiled executable again with
the devices renamed (the serialized executable, its device assignment replaced, as jax's
persistent cache loads an entry on GPUs): a copy costs a load (milliseconds) instead of a
compile (seconds). The program's code is the same; only where it runs changes.

:func:`placement` is the key part: the specs' shardings with their devices abstracted, and the
devices they name, so that two jobs with the same abstract placement are the same program on
other devices.

This reads jax internals (the executable behind a ``jax.stages.Compiled`` and its pickler):
where they change, :func:`relocate` raises and the caller compiles instead.
"""

from __future__ import annotations

import io

import jax
import numpy as np
from jax.experimental import serialize_executable as _serialize
from jax.sharding import NamedSharding, SingleDeviceSharding


def placement(specs):
    """``(structure, devices)`` of a pytree of ``jax.ShapeDtypeStruct`` with shardings:
    ``structure`` is per leaf its sharding with devices replaced by their positions in
    ``devices`` (the devices in order of first use). None when a leaf's sharding is of
    another kind (no relocation)."""
    devices, index, out = [], {}, []
    for leaf in jax.tree.leaves(specs):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, SingleDeviceSharding):
            devs, kind = tuple(sh.device_set), ("single",)
        elif isinstance(sh, NamedSharding):
            mesh = sh.mesh
            devs = tuple(mesh.devices.flat)
            kind = ("named", tuple(mesh.axis_names), tuple(mesh.devices.shape), str(mesh.axis_types), sh.spec)
        else:
            return None
        for d in devs:
            if d not in index:
                index[d] = len(devices)
                devices.append(d)
        out.append((*kind, sh.memory_kind, tuple(index[d] for d in devs)))
    return tuple(out), tuple(devices)


class _Unpickler(_serialize._JaxPjrtUnpickler):
    """jax's executable unpickler, with every device renamed and the executable loaded
    under the new device assignment."""

    def __init__(self, payload: bytes, mapping: dict, new_devices: list, options):
        super().__init__(io.BytesIO(payload), new_devices[0].client, new_devices)
        self.devices_by_id = {old.id: new for old, new in mapping.items()}
        self.options = options

    def persistent_load(self, pid):
        if pid[0] == "exec":
            return self.backend.deserialize_executable(pid[1], executable_devices=self.execution_devices,
                                                       compile_options=self.options)
        return super().persistent_load(pid)


def relocate(compiled, mapping: dict):
    """``compiled`` (a ``jax.stages.Compiled``) loaded so that it runs on ``mapping[d]``
    wherever it ran on device ``d``. Raises (KeyError, ValueError, ...) when it cannot: a
    device of the program missing from ``mapping``, a program jax cannot serialize."""
    from jax._src import compiler   # the compile options jax itself passes when it loads

    unloaded = compiled._executable._unloaded_executable
    new = [mapping[d] for d in unloaded.device_list]
    if len(set(new)) != len(new):
        raise ValueError("a relocation must keep the program's devices distinct")
    assignment = np.array([new], dtype=object) if len(new) > 1 else new
    options = compiler.get_compile_options(num_replicas=1, num_partitions=len(new), device_assignment=assignment,
                                           backend=new[0].client)
    payload, in_tree, out_tree = _serialize.serialize(compiled)
    loaded, args_info, no_kwargs = _Unpickler(payload, mapping, new, options).load()
    return jax.stages.Compiled(loaded.load(), [], in_tree.unflatten(args_info), out_tree, no_kwargs=no_kwargs)


def run_once(compiled, specs) -> None:
    """Run a compiled program once on zeros shaped and placed like ``specs``: XLA:CPU's first
    run of a loaded executable costs tens of milliseconds more than the next ones (measured:
    a stage forward 30 ms, then 2 ms), which would otherwise land in the first step."""
    args = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), specs)
    jax.block_until_ready(compiled(*args))
