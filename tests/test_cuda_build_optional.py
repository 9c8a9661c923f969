"""The CUDA library is optional: CMake skips it cleanly with FTHSDP_CUDA=OFF and
where no nvcc can be found, and everything else still configures.

Configure only (no compilation): what is checked is the decision, the message
and that no fthsdp_cuda target exists. Where nvcc is installed the default
build makes libfthsdp_cuda.so (tests/test_ffi_api_version.py checks what it
declares); tests/test_staging.py tests its host-side protocol on the CPU.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
CMAKE = shutil.which("cmake", path=str(BIN)) or shutil.which("cmake")
NINJA = shutil.which("ninja", path=str(BIN)) or shutil.which("ninja")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CMAKE is None or NINJA is None, reason="cmake/ninja not installed (make install)"),
]


def configure(build: pathlib.Path, *defs: str, env: dict | None = None) -> str:
    r = subprocess.run([CMAKE, "-S", str(REPO), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={NINJA}",
                        f"-DPython_EXECUTABLE={sys.executable}", *defs],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def assert_cuda_skipped(build: pathlib.Path, out: str) -> None:
    assert "fthsdp: CUDA kernels skipped" in out, out[-2000:]
    ninja = (build / "build.ninja").read_text()
    assert "fthsdp_cuda" not in ninja
    assert "_ffi" in ninja and "fthsdp_staging_test" in ninja  # the rest is still there


def test_cuda_off_is_skipped_cleanly(tmp_path):
    assert_cuda_skipped(tmp_path, configure(tmp_path, "-DFTHSDP_CUDA=OFF"))


def test_no_usable_nvcc_is_skipped_cleanly(tmp_path):
    """As on a host without the CUDA toolkit: CMake's CUDA compiler search
    (CUDACXX first) finds nothing usable, and the build goes on without it."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_PATH", "CUDA_HOME")}
    env["CUDACXX"] = str(tmp_path / "no-such-dir" / "nvcc")
    build = tmp_path / "build"
    assert_cuda_skipped(build, configure(build, env=env))
