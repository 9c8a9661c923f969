"""Process-level device setup that must happen before jax initialises."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence


def force_host_devices(n: int) -> None:
    """Ask XLA for `n` CPU devices in this process (must run before jax starts).

    On a GPU host this flag is harmless: it only affects the CPU platform.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    flag = f"--xla_force_host_platform_device_count={n}"
    if "xla_force_host_platform_device_count" in flags:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", flag, flags)
    else:
        flags = (flags + " " + flag).strip()
    os.environ["XLA_FLAGS"] = flags


def enable_compilation_cache(path: str | None = None) -> None:
    """Share XLA's persistent compilation cache between this job's processes."""
    import jax

    path = path or os.environ.get("FTHSDP_COMPILATION_CACHE") or os.path.expanduser("~/.cache/fthsdp/xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# ---------------------------------------------------------------------------
# GPUs: the replicas of a local job (`fthsdp run`) are separate processes. With
# enough GPUs each replica gets its own; with fewer (one H100 shared by 2-3
# replicas) they share, and each process takes a fraction of the GPU memory
# instead of XLA's default 75% (which would leave the second replica nothing).


@dataclasses.dataclass(frozen=True)
class GpuPlacement:
    """What one replica process should see before jax starts."""

    visible: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES entries; None: leave as is
    mem_fraction: float | None  # XLA_PYTHON_CLIENT_MEM_FRACTION; None: XLA's default


def gpu_placement(replica_id: int, replicas: int, devices_per_replica: int,
                  gpus: Sequence[str]) -> GpuPlacement:
    """Pure: which GPUs replica `replica_id` of `replicas` uses, and its memory share.

    Disjoint GPUs when there are enough (replica r gets gpus[r*D:(r+1)*D]);
    otherwise replicas share round-robin and each takes an equal share of
    90% of a GPU's memory (capped at XLA's default 75%).
    """
    if not gpus or replicas < 1 or devices_per_replica < 1:
        return GpuPlacement(None, None)
    d, g = devices_per_replica, len(gpus)
    if d > g:  # cannot give this replica D distinct GPUs: replica_mesh reports it
        return GpuPlacement(None, None)
    if replicas * d <= g:
        return GpuPlacement(tuple(gpus[replica_id * d:(replica_id + 1) * d]), None)
    start = (replica_id * d) % g
    mine = tuple(gpus[(start + i) % g] for i in range(d))
    sharing = -(-replicas * d // g)  # processes per GPU, rounded up
    return GpuPlacement(mine, round(min(0.75, 0.9 / sharing), 3))


def visible_gpus() -> list[str]:
    """GPU ids this process may use, without initialising CUDA or jax.

    CUDA_VISIBLE_DEVICES when set; else the GPUs `nvidia-smi -L` lists; else
    none (no driver, or JAX_PLATFORMS excludes GPUs).
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [x for x in env.split(",") if x.strip() and x.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


# Set by a launcher that placed its processes itself (launcher_gpu_env): the process keeps its env.
PLACED_ENV = "FTHSDP_GPUS_PLACED"


def launcher_gpu_env(replica_id: int, replicas: int, devices_per_replica: int, process_index: int = 0,
                     processes: int = 1, gpus: Sequence[str] | None = None,
                     environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a launcher sets in one replica process's environment: its GPUs among ``gpus`` (default:
    the launcher's own visible ones), one slot per process (replica r's process p is slot r*P+p,
    each of ``devices_per_replica`` GPUs: a replica's mesh takes that many per process).

    Why the launcher and not the process: a CUDA_VISIBLE_DEVICES the launcher inherited (a Slurm
    allocation, a shared box) is the pool to split, but passed on unchanged it read as the user's
    own choice in every replica, and all of them stacked on its first GPUs. {} without GPUs."""
    environ = os.environ if environ is None else environ
    pool = visible_gpus() if gpus is None else list(gpus)
    p = gpu_placement(replica_id * processes + process_index, replicas * processes, devices_per_replica, pool)
    if p.visible is None:
        return {}
    out = {"CUDA_VISIBLE_DEVICES": ",".join(p.visible), PLACED_ENV: "1"}
    out.update(_mem_fraction_env(p, environ))
    return out


def _mem_fraction_env(p: GpuPlacement, environ: Mapping[str, str]) -> dict[str, str]:
    """The memory share to set, unless the user chose one (or chose no preallocation) already."""
    if (p.mem_fraction is None or "XLA_PYTHON_CLIENT_MEM_FRACTION" in environ
            or "XLA_PYTHON_CLIENT_PREALLOCATE" in environ):
        return {}
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": str(p.mem_fraction)}


def place_replica_on_gpus(replica_id: int, replicas: int, devices_per_replica: int) -> GpuPlacement:
    """Apply `gpu_placement` to this process's environment (before jax starts).

    A user's own CUDA_VISIBLE_DEVICES / XLA_PYTHON_CLIENT_MEM_FRACTION /
    XLA_PYTHON_CLIENT_PREALLOCATE settings win, and so does a launcher's
    placement (:func:`launcher_gpu_env`); on a host without GPUs this does
    nothing.
    """
    if os.environ.get(PLACED_ENV):
        return GpuPlacement(None, None)
    p = gpu_placement(replica_id, replicas, devices_per_replica, visible_gpus())
    if p.visible is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(p.visible)
    os.environ.update(_mem_fraction_env(p, os.environ))
    return p
