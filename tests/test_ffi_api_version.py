"""The built handlers declare an XLA FFI API the oldest supported jaxlib accepts.

jaxlib 0.11.2 refuses a handler that declares FFI API 0.5 ("the handler's API
version (0.5) is incompatible with the framework's API version (0.4)"), which
is what a build against jax 0.12's headers produces. The version is read from
the built handlers themselves, through the FFI metadata extension (the query
XLA makes at registration), not from a header.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import jax
import pytest

from fthsdp.collective import native

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_every_built_handler_declares_an_api_the_oldest_jaxlib_accepts():
    versions = native.declared_api_versions()
    assert {"fthsdp_reduce_sum@cpu", "fthsdp_ftar@cpu"} <= set(versions)
    if native.cuda_library_path() is not None:  # built wherever nvcc was found
        assert {"fthsdp_reduce_sum@cuda", "fthsdp_ftar@cuda"} <= set(versions)
    too_new = {k: v for k, v in versions.items() if v > native.MAX_FFI_API}
    assert not too_new, (
        f"handlers declare XLA FFI API {too_new}, newer than {native.MAX_FFI_API} which jaxlib 0.11.2 "
        "accepts: rebuild against the oldest supported jaxlib's FFI headers (CMakeLists.txt does)")
    assert all(v[0] == 0 and v[1] >= 1 for v in versions.values()), versions


def test_registration_and_a_call_still_work_on_the_installed_jax():
    """An older declared API is accepted by the newer installed jaxlib."""
    import jax.numpy as jnp
    import numpy as np

    from fthsdp.collective import ops

    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        a = jnp.arange(5, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(jax.jit(ops.reduce_sum)(a, a)), np.arange(5) * 2.0)


def test_header_finder_prefers_old_enough_headers(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import ffi_headers
    finally:
        sys.path.pop(0)
    fake = tmp_path / "inc" / "xla" / "ffi" / "api"
    fake.mkdir(parents=True)
    (fake / "c_api.h").write_text("#define XLA_FFI_API_MAJOR 0\n#define XLA_FFI_API_MINOR 5\n")
    assert ffi_headers.declared_api(tmp_path / "inc") == (0, 5)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "ffi_headers.py"), "--cache",
                        str(tmp_path / "cache"), "--include", str(tmp_path / "inc")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "declares XLA FFI API (0, 5)" in r.stderr, r.stderr


def test_the_probe_detects_a_handler_built_against_newer_headers(tmp_path):
    """The check can fail: a handler compiled against the installed jax's headers
    reports their version (0.5 on jax 0.12), which the first test would refuse."""
    compiler = shutil.which("c++") or shutil.which("g++")
    include = pathlib.Path(jax.ffi.include_dir())
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import ffi_headers
    finally:
        sys.path.pop(0)
    installed = ffi_headers.declared_api(include)
    if compiler is None or installed is None:
        pytest.skip("no C++ compiler or no FFI headers in the installed jaxlib")
    src = tmp_path / "h.cc"
    src.write_text(
        '#include "xla/ffi/api/ffi.h"\n'
        "namespace ffi = xla::ffi;\n"
        "static ffi::Error Impl(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }\n"
        "XLA_FFI_DEFINE_HANDLER_SYMBOL(Probe, Impl, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());\n")
    lib = tmp_path / "libprobe.so"
    r = subprocess.run([compiler, "-std=c++17", "-O0", "-shared", "-fPIC", "-w", f"-I{include}", str(src),
                        "-o", str(lib)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    import ctypes

    probe = ctypes.CDLL(str(lib))
    got = native.handler_api_version(ctypes.cast(probe.Probe, ctypes.c_void_p).value)
    assert got == installed
