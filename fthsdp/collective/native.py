"""Loads the native libraries and registers their XLA FFI targets with jax, once.

Registration must happen after jax's backends exist, so it is
done lazily by `ensure_registered()` rather than at import time.

Two libraries: `fthsdp._ffi` (CPU handlers and the FTAR control plane; always
there) and `libfthsdp_cuda.so` (CUDA handlers; built only where nvcc was
found, loaded only when jax has a GPU backend, so nothing CUDA is needed to
import fthsdp or to run on CPU). The CUDA library drives no network itself:
it is handed the control plane's C table (`FthsdpCudaInit`) before its
handlers are registered.

Both are compiled against the XLA FFI headers of the oldest supported jaxlib
(see CMakeLists.txt); `declared_api_versions()` reads back what the built
handlers declare, through the FFI metadata extension, so a test can refuse a
library that the oldest jaxlib would reject.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import pathlib

import jax

log = logging.getLogger(__name__)

ABI_VERSION = 1
# The newest XLA FFI API the oldest supported jaxlib (0.11.2) accepts.
MAX_FFI_API = (0, 4)


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


def has_gpu() -> bool:
    """Whether jax has a GPU backend with at least one device in this process."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@functools.cache
def ensure_registered() -> tuple[str, ...]:
    """Registers every FFI target of the libraries; returns "name@platform" for each."""
    jax.devices()  # the backends must exist before targets are registered
    names = []
    for name, capsule in module().registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        names.append(f"{name}@cpu")
    if has_gpu():
        cuda = cuda_library()
        if cuda is None:
            # Not fatal: programs pinned to the CPU still work; a GPU all-reduce
            # fails with XLA's "No FFI handler registered ... CUDA".
            log.warning("jax has a GPU backend but fthsdp's CUDA library (libfthsdp_cuda.so) was not "
                        "built: install the CUDA toolkit (nvcc) and rebuild with `make install`, or "
                        "run on CPU (JAX_PLATFORMS=cpu)")
            return tuple(names)
        _init_cuda(cuda)
        for name, symbol in CUDA_HANDLERS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(cuda, symbol)), platform="CUDA")
            names.append(f"{name}@cuda")
    return tuple(names)


# FFI target name -> exported handler symbol of libfthsdp_cuda.so.
CUDA_HANDLERS = {"fthsdp_reduce_sum": "FthsdpReduceSumCuda", "fthsdp_ftar": "FthsdpFtarCuda"}


def cuda_library_path() -> pathlib.Path | None:
    """The built CUDA library beside the extension, or None where nvcc was not found."""
    here = pathlib.Path(module().__file__).parent
    found = sorted(here.glob("*fthsdp_cuda*.so"))
    return found[0] if found else None


@functools.cache
def cuda_library() -> ctypes.CDLL | None:
    """The CUDA handler library (loading it needs no GPU: its CUDA runtime is static and lazy)."""
    path = cuda_library_path()
    return None if path is None else ctypes.CDLL(str(path))


def _init_cuda(cuda: ctypes.CDLL) -> None:
    mod = module()
    cuda.FthsdpCudaStagingAbi.restype = ctypes.c_int
    if cuda.FthsdpCudaStagingAbi() != mod.STAGING_ABI:
        raise NativeLibraryError(
            f"libfthsdp_cuda.so speaks staging ABI {cuda.FthsdpCudaStagingAbi()}, fthsdp._ffi "
            f"{mod.STAGING_ABI}: rebuild both with `make install`."
        )
    cuda.FthsdpCudaInit.argtypes = [ctypes.c_void_p]
    cuda.FthsdpCudaInit.restype = ctypes.c_int
    if cuda.FthsdpCudaInit(ctypes.c_void_p(mod.host_api_address())) != 0:
        raise NativeLibraryError("libfthsdp_cuda.so refused the control plane's staging table")


# ---------------------------------------------------------------------------
# The FFI API version the built handlers declare (FFI metadata extension).
# The structs follow xla/ffi/api/c_api.h; their layout is the same in every
# FFI API 0.x that jax >= 0.11.2 ships.


class _InternalExtension(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int), ("next", ctypes.c_void_p)]


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion),
                ("traits", ctypes.c_uint32), ("state_type_id", ctypes.c_int64)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _InternalExtension), ("metadata", ctypes.POINTER(_Metadata))]


class _Span(ctypes.Structure):  # XLA_FFI_Args / Rets (+ names for Attrs)
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.c_void_p), ("items", ctypes.c_void_p)]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.c_void_p), ("names", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p)]


class _CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api", ctypes.c_void_p), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
                ("args", _Span), ("rets", _Span), ("attrs", _Attrs), ("future", ctypes.c_void_p)]


_EXTENSION_METADATA = 1
_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))


def handler_api_version(address: int) -> tuple[int, int]:
    """(major, minor) of the XLA FFI API the handler at `address` was compiled against.

    Calls the handler the way XLA does at registration: a call frame carrying
    the metadata extension, to which an XLA FFI handler answers with the
    version of the headers it was built with (and does nothing else).
    """
    meta = _Metadata(struct_size=_Metadata.traits.offset + ctypes.sizeof(ctypes.c_uint32))
    ext = _MetadataExtension(
        extension_base=_InternalExtension(struct_size=ctypes.sizeof(_MetadataExtension),
                                          type=_EXTENSION_METADATA, next=None),
        metadata=ctypes.pointer(meta))
    frame = _CallFrame(struct_size=_CallFrame.future.offset,
                       extension_start=ctypes.cast(ctypes.pointer(ext), ctypes.c_void_p))
    err = _HANDLER(address)(ctypes.byref(frame))
    if err:
        raise NativeLibraryError(f"handler at {address:#x} refused the metadata query")
    return meta.api_version.major_version, meta.api_version.minor_version


def _capsule_address(capsule) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, None)


def declared_api_versions() -> dict[str, tuple[int, int]]:
    """The FFI API version every built handler declares: "name@platform" -> (major, minor)."""
    out = {f"{name}@cpu": handler_api_version(_capsule_address(capsule))
           for name, capsule in module().registrations().items()}
    cuda = cuda_library()
    if cuda is not None:
        for name, symbol in CUDA_HANDLERS.items():
            out[f"{name}@cuda"] = handler_api_version(ctypes.cast(getattr(cuda, symbol), ctypes.c_void_p).value)
    return out
