"""The native CPU reduce kernel (FTAR's CPU data plane) against numpy.

Every computation names the CPU device, so these stay CPU tests on a host
whose default backend is a GPU (the CUDA kernel is checked bitwise in
tests/test_gpu_ftar.py)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fthsdp.collective import ops

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
# Not multiples of any vector width (4/8/16 lanes), plus the block size edge of the aliasing path.
SIZES = [1, 3, 7, 17, 31, 33, 255, 4095, 4097, 100_003]


def _device(platform="cpu"):
    return jax.devices(platform)[0]


def _inputs(n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * 10).astype(np.float32)
    b = (rng.standard_normal(n) * 10).astype(np.float32)
    return a.astype(dtype), b.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
def test_reduce_matches_numpy_bitwise(dtype, n):
    a, b = _inputs(n, dtype, seed=n)
    expected = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)
    dev = _device()
    got = np.asarray(jax.jit(ops.reduce_sum)(jax.device_put(a, dev), jax.device_put(b, dev)))
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bfloat16", "float16"])
def test_half_precision_rounds_to_nearest_even_and_keeps_specials(dtype):
    specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 65504.0, 1e-7, 3.0e38], np.float32)
    a = specials.astype(dtype)
    b = np.array([1.0, -1.0, 1.0, -0.0, -0.0, 65504.0, 1e-7, 3.0e38], np.float32).astype(dtype)
    expected = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)
    dev = _device()
    got = np.asarray(ops.reduce_sum(jax.device_put(a, dev), jax.device_put(b, dev)))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), np.isnan(expected.astype(np.float32)))
    finite = ~np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(got[finite].view(np.uint16), expected[finite].view(np.uint16))


def test_reduce_multidimensional_and_inside_larger_program():
    a = jax.device_put(jnp.arange(6 * 7, dtype=jnp.float32).reshape(6, 7), _device("cpu"))
    f = jax.jit(lambda x, y: ops.reduce_sum(x * 2, y) - 1)
    np.testing.assert_array_equal(np.asarray(f(a, a)), np.asarray(a) * 3 - 1)


def test_reduce_rejects_mismatched_operands_clearly():
    with pytest.raises(ValueError, match="one shape and dtype"):
        ops.reduce_sum(jnp.zeros(3), jnp.zeros(4))  # refused before any device is involved
    with pytest.raises(TypeError, match="float32, bfloat16 and float16"):
        ops.reduce_sum(jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32))


def test_handler_reports_bad_dtype_as_ffi_error():
    """Bypass the Python checks: the C++ handler itself must refuse, not crash."""
    from fthsdp.collective import native

    native.ensure_registered()
    call = jax.ffi.ffi_call("fthsdp_reduce_sum", jax.ShapeDtypeStruct((4,), jnp.int32))
    z = jax.device_put(np.zeros(4, np.int32), _device("cpu"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="unsupported dtype"):
        jax.block_until_ready(call(z, z))
