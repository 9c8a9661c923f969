"""Process-level device setup that must happen before jax initialises."""

from __future__ import annotations

import os
import re


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
