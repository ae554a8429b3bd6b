"""Host-side input checks of :mod:`pdjax.model.checks` that the entry points' tests leave
unpinned: device tokens come back as int32, host lengths at the ends of their range. Found by
mutation testing (docs/mutation.md)."""

import jax.numpy as jnp
import numpy as np
import pytest

import pdjax
from pdjax.model.checks import check_lengths, check_tokens

CFG = pdjax.configs.tiny()


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int16, jnp.uint8])
def test_device_tokens_come_back_as_int32_with_their_values(dtype):
    """Token ids on the device, of any integer dtype, are returned as int32 with the same
    values (not range-checked, not fetched)."""
    tokens = jnp.asarray([[1, 2, 3], [4, 5, 6]], dtype)
    out = check_tokens(CFG, tokens, 2)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), [[1, 2, 3], [4, 5, 6]])


def test_host_lengths_span_one_to_the_chunk_length():
    """Host lengths of a [B, T] chunk are int32 values in [1, T] (both ends accepted), from a
    list or a numpy array of any integer dtype; 0, T + 1 and bools are refused; None means
    T for every row."""
    for lengths in ([1, 4], np.array([1, 4], np.int64), np.array([1, 4], np.uint8)):
        out = check_lengths(lengths, 2, 4)
        assert out.dtype == np.int32 and out.tolist() == [1, 4]
    assert check_lengths(None, 2, 4).tolist() == [4, 4]
    for bad in ([0, 4], [1, 5], [True, True], [1, 2, 3]):
        with pytest.raises(ValueError, match=r"lengths must be \[B=2\]"):
            check_lengths(bad, 2, 4)
