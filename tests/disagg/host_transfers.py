"""Test-only: count what a decode step moves between the host and the devices."""

import contextlib

import jax
import pytest
from jax._src.array import ArrayImpl


@contextlib.contextmanager
def device_fetches():
    """Inside, an explicit host-to-device copy raises; yields the list the shape of every
    real device-to-host copy is appended to (counted at ``ArrayImpl._value``: on CPU
    ``transfer_guard_device_to_host`` never fires)."""
    fetches = []
    value = ArrayImpl._value

    def counted(self):
        if self._npy_value is None:                        # a real device-to-host copy
            fetches.append(self.shape)
        return value.fget(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ArrayImpl, "_value", property(counted))
        with jax.transfer_guard_host_to_device("disallow_explicit"):
            yield fetches
