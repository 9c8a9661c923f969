"""FTAR's GPU staging protocol, tested on the CPU (no GPU needed).

ffi/tests/staging_test.cc drives the host side of the GPU path (the staging
queue behind the CUDA handler and the receive slots and job ring of the
reduce on the device, through the same C table) with threads per rank
standing in for the GPU stream and its reduce worker kernel, over real
loopback rings: sums bitwise equal to the CPU FTAR (f32/bf16/f16, rings of
2-4, sizes not multiples of the chunk) with every reduce-scatter addition
made by the stand-in worker, a slow worker that runs the control thread out
of receive slots, and a waiting stream and worker always released (abort,
deadline, dead peer, stalled stream, wedged device, fatal errors reported
once). Built by CMake beside the
extension; skipped if not built.
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.multiprocess


def test_cpp_staging_protocol_unit_test_binary():
    found = sorted(REPO.glob("build/*/fthsdp_staging_test"))
    if not found:
        pytest.skip("fthsdp_staging_test not built (make install)")
    r = subprocess.run([str(found[-1])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "staging: all cases passed" in r.stdout


def test_host_api_table_is_exported_by_the_extension():
    from fthsdp.collective import native

    mod = native.module()
    assert mod.STAGING_ABI == 2
    assert mod.host_api_address() != 0
