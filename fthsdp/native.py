"""Loads the native library and registers its XLA FFI targets with jax, once.

Registration must happen after jax's CPU backend exists (DESIGN.md), so it is
done lazily by `ensure_registered()` rather than at import time.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import jax

ABI_VERSION = 1


class NativeLibraryError(ImportError):
    """The compiled extension is missing or does not match this Python package."""


@functools.cache
def module():
    """The nanobind module `fthsdp._ffi`."""
    try:
        from fthsdp import _ffi  # type: ignore[attr-defined]
    except ImportError as e:  # pragma: no cover - depends on the install
        raise NativeLibraryError(
            "fthsdp's native extension (fthsdp._ffi) is not built. Run `make install` "
            "(or `pip install --no-build-isolation -e .`) from the repository root."
        ) from e
    if getattr(_ffi, "ABI_VERSION", None) != ABI_VERSION:
        raise NativeLibraryError(
            f"fthsdp._ffi has ABI {getattr(_ffi, 'ABI_VERSION', None)}, the Python package "
            f"expects {ABI_VERSION}: rebuild with `make install`."
        )
    return _ffi


@functools.cache
def ensure_registered() -> tuple[str, ...]:
    """Registers every FFI target of the library; returns their names."""
    jax.devices()  # the CPU backend must exist before targets are registered
    names = []
    for name, capsule in module().registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        names.append(name)
    cuda = _cuda_library()
    if cuda is not None:
        jax.ffi.register_ffi_target(
            "fthsdp_reduce_sum", jax.ffi.pycapsule(cuda.FthsdpReduceSumCuda), platform="CUDA"
        )
    return tuple(names)


def _cuda_library() -> ctypes.CDLL | None:
    """The CUDA kernels, when they were built and jax has a GPU backend."""
    try:
        if not jax.devices("gpu"):
            return None
    except RuntimeError:
        return None
    here = pathlib.Path(module().__file__).parent
    for path in here.glob("*fthsdp_cuda*.so"):
        return ctypes.CDLL(str(path))
    return None
