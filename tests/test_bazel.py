"""BUILD.bazel builds the same FFI library CMake builds, offline, and jax can call it.

Skipped when `bazel` is not on PATH (install it with `bash scripts/install_system_deps.sh`).
The build runs in `--batch` mode (no Bazel server is left running) under a temporary
output_user_root outside the git tree, with every proxy pointed at a closed loopback
port so that a build that tried to download anything would fail rather than pass.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BAZEL = shutil.which("bazel")
TARGET = "//:libfthsdp_ffi.so"
# Registered under its own name so it never clashes with the CMake-built module's targets.
JAX_TARGET = "fthsdp_bazel_reduce_sum"
BUILD_TIMEOUT_S = 480

pytestmark = pytest.mark.skipif(
    BAZEL is None,
    reason="bazel is not on PATH; run `bash scripts/install_system_deps.sh` "
    "(Debian: apt-get install bazel-bootstrap) to enable the Bazel build test",
)


def offline_flags() -> list[str]:
    """Points @rules_cc / @rules_java at the local stand-ins (Bazel 4 would download them)."""
    stand_ins = REPO / "third_party" / "bazel"
    return [
        f"--override_repository=rules_cc={stand_ins / 'rules_cc'}",
        f"--override_repository=rules_java={stand_ins / 'rules_java'}",
    ]


def handler_symbols() -> list[str]:
    """Every C handler symbol declared in ffi/handlers.h: the library's whole public ABI."""
    header = (REPO / "ffi" / "handlers.h").read_text()
    names = re.findall(r"XLA_FFI_Error\s*\*\s*(\w+)\s*\(\s*XLA_FFI_CallFrame", header)
    assert names, "ffi/handlers.h declares no XLA_FFI_Error* Name(XLA_FFI_CallFrame*) handlers"
    return names


def _force_remove(root: pathlib.Path) -> None:
    """Deletes a Bazel output root, whose action outputs are made read-only."""

    def make_writable_and_retry(func, path, _exc):
        os.chmod(path, stat.S_IRWXU)
        parent = os.path.dirname(path)
        os.chmod(parent, stat.S_IRWXU)
        func(path)

    if sys.version_info >= (3, 12):
        shutil.rmtree(root, onexc=make_writable_and_retry)
    else:  # pragma: no cover
        shutil.rmtree(root, onerror=make_writable_and_retry)


def bazel_build(
    work: pathlib.Path, python: str, keep: pathlib.Path | None = None
) -> tuple[subprocess.CompletedProcess, float]:
    """Builds TARGET offline in --batch mode under a fresh output_user_root in `work`.

    Copies the built library to `keep` (when given) before Bazel's output root is
    deleted; nothing is left in the git tree or running. Returns the finished
    process and its wall time.
    """
    user_root = work / "output_user_root"
    env = dict(os.environ)
    env["FTHSDP_PYTHON"] = python  # the Python whose jaxlib supplies the FFI headers
    dead_proxy = "http://127.0.0.1:9"  # discard port: nothing listens, downloads fail at once
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env[var] = dead_proxy
    env.pop("no_proxy", None)
    env.pop("NO_PROXY", None)
    cmd = [
        BAZEL,
        "--batch",
        f"--output_user_root={user_root}",
        "build",
        *offline_flags(),
        f"--symlink_prefix={work}/out-",
        "--color=no",
        "--curses=no",
        TARGET,
    ]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        built = work / "out-bin" / "libfthsdp_ffi.so"
        if keep is not None and proc.returncode == 0 and built.is_file():
            shutil.copyfile(built, keep)
    finally:
        # Bazel 4 adds ./bazel-out whatever --symlink_prefix says; drop it when it is ours.
        out_link = REPO / "bazel-out"
        if out_link.is_symlink() and str(work) in os.readlink(out_link):
            out_link.unlink()
        if user_root.exists():
            _force_remove(user_root)
    return proc, time.monotonic() - start


def _log_tail(proc: subprocess.CompletedProcess, lines: int = 40) -> str:
    """Bazel's stderr without the sandbox's debug chatter."""
    kept = [ln for ln in proc.stderr.splitlines() if "linux-sandbox" not in ln]
    return "\n".join(kept[-lines:])


@pytest.fixture(scope="module")
def bazel_library(tmp_path_factory) -> pathlib.Path:
    """Builds the target once with Bazel; returns a copy of the .so outside Bazel's tree."""
    work = tmp_path_factory.mktemp("bazel")
    lib = work / "libfthsdp_ffi.so"
    proc, elapsed = bazel_build(work, sys.executable, keep=lib)
    if proc.returncode != 0:
        pytest.fail(
            f"bazel build {TARGET} failed (exit {proc.returncode}, {elapsed:.1f}s):\n"
            + _log_tail(proc)
        )
    assert lib.is_file(), f"bazel reported success but built no {lib.name}"
    print(f"bazel build of {TARGET}: {elapsed:.1f}s")
    return lib


def test_python_without_jax_is_a_clear_error(tmp_path):
    """FTHSDP_PYTHON is authoritative: one without jax fails and says what to do."""
    bare = tmp_path / "bare-venv"  # a real Python 3.12 with nothing installed
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    no_jax = bare / "bin" / "python"
    proc, _ = bazel_build(tmp_path, str(no_jax))
    assert proc.returncode != 0, "the build succeeded with a Python that cannot import jax"
    assert "no Python with jax found" in proc.stderr, _log_tail(proc)
    assert "FTHSDP_PYTHON" in proc.stderr, _log_tail(proc)
    assert "No module named 'jax'" in proc.stderr, _log_tail(proc)


def test_build_leaves_nothing_in_the_tree(bazel_library):
    assert bazel_library.stat().st_size > 0
    leftovers = sorted(p.name for p in REPO.glob("bazel-*"))
    assert not leftovers, f"the Bazel build created convenience links in the repo: {leftovers}"


def test_library_exports_every_handler_symbol(bazel_library):
    lib = ctypes.CDLL(str(bazel_library))
    missing = [name for name in handler_symbols() if not hasattr(lib, name)]
    assert not missing, f"{bazel_library.name} does not export {missing}"


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("size", [1, 1027, 4099])
def test_bazel_built_reduce_sum_matches_numpy(bazel_library, dtype_name, size):
    import jax
    import jax.numpy as jnp

    _register(bazel_library)
    dtype = jnp.dtype(dtype_name)
    rng = np.random.default_rng(size)
    a = rng.standard_normal(size).astype(np.float32).astype(dtype)
    b = rng.standard_normal(size).astype(np.float32).astype(dtype)

    @jax.jit
    def reduce_sum(x, y):
        return jax.ffi.ffi_call(JAX_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)

    out = np.asarray(reduce_sum(a, b))
    assert out.dtype == dtype
    # One rounding of the exact f32 sum to the storage type, as numpy does it.
    expected = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)
    np.testing.assert_array_equal(out.astype(np.float32), expected.astype(np.float32))


_registered: set[str] = set()


def _register(library: pathlib.Path) -> None:
    """Registers the Bazel-built handler with jax once (after the CPU backend exists)."""
    import jax

    if JAX_TARGET in _registered:
        return
    jax.devices()
    lib = ctypes.CDLL(str(library))
    jax.ffi.register_ffi_target(JAX_TARGET, jax.ffi.pycapsule(lib.FthsdpReduceSum), platform="cpu")
    _registered.add(JAX_TARGET)
