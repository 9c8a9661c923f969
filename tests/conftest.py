"""Test-wide setup: 4 host devices for in-process sharding tests, a shared
XLA compilation cache for the many processes the multi-process tests start,
and the `slow` marker's rule: tests marked slow (the longest end-to-end
variants) run only with FTHSDP_RUN_SLOW=1 (`make test-all`), so `make test`
(CI) stays well under its 30-minute budget on 2 cores. Most sit beside a
shorter test of the same feature; a few have none and are covered only by
`make test-all`: CMake configuring without CUDA (tests/test_cuda_build_optional.py),
a Ray node's loss (tests/test_ray_nodes.py), a replica of several processes
resuming from its checkpoint, the Ray lighthouse actor restarted, and one
peer-server security variant."""

import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
CACHE = os.environ.setdefault("FTHSDP_COMPILATION_CACHE", str(REPO / ".cache" / "xla-tests"))

# Must happen before jax is imported anywhere in this process.
from fthsdp.devices import force_host_devices  # noqa: E402

force_host_devices(4)
# The suite is a CPU suite (forced host devices, CPU replicas): pin it and every
# process it starts to the CPU platform, so it means the same on a host whose
# default jax backend is a GPU. Set, not defaulted: a GPU host's environment
# may name cuda already (tests/test_step.py and friends then met one GPU
# where they expect four CPU devices). GPU tests (marked `gpu`) run their GPU
# work in subprocesses that set JAX_PLATFORMS themselves (tests/test_gpu_ftar.py).
os.environ["JAX_PLATFORMS"] = "cpu"

import pytest  # noqa: E402


RUN_SLOW = os.environ.get("FTHSDP_RUN_SLOW", "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    if RUN_SLOW:
        return
    skip = pytest.mark.skip(reason="slow end-to-end variant: run with FTHSDP_RUN_SLOW=1 (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache():
    from fthsdp.devices import enable_compilation_cache

    enable_compilation_cache(CACHE)


@pytest.fixture
def python_exe() -> str:
    return sys.executable
