"""Small jax-callable wrappers around the native FFI kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fthsdp.collective import native

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def reduce_sum(a: jax.Array, b: jax.Array) -> jax.Array:
    """a + b through FTAR's vectorised native reduce kernel (usable inside jit)."""
    native.ensure_registered()
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"reduce_sum needs operands of one shape and dtype, got {a.shape}/{a.dtype} "
            f"and {b.shape}/{b.dtype}"
        )
    if a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"reduce_sum supports float32, bfloat16 and float16, not {a.dtype}")
    return jax.ffi.ffi_call("fthsdp_reduce_sum", jax.ShapeDtypeStruct(a.shape, a.dtype))(a, b)
