"""Finds (or fetches) XLA FFI headers of the OLDEST jaxlib fthsdp supports.

Why: a handler compiled against newer FFI headers declares a newer FFI API
version, and an older jaxlib refuses to register it ("handler's API version
(0.5) is incompatible with the framework's API version (0.4)"). jaxlib accepts
handlers that declare an older API, so building against the oldest supported
jaxlib's headers gives one library that loads on every supported jax.

Order: an explicit directory (--include or $FTHSDP_FFI_INCLUDE); a cached copy
under --cache; the installed jaxlib's headers when they are not newer than the
pinned API; else `pip download jaxlib==VERSION --no-deps` (pip's own cache
makes that cheap after the first time) and only the FFI headers are extracted.
Prints the include directory (the one holding xla/ffi/api/ffi.h) on stdout.
Third-party headers are never written into the source tree's tracked files:
the cache lives under an ignored directory.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

API_PREFIX = "jaxlib/include/xla/ffi/api/"


def declared_api(include: pathlib.Path) -> tuple[int, int] | None:
    """(major, minor) that c_api.h under `include` declares, or None if absent."""
    header = include / "xla" / "ffi" / "api" / "c_api.h"
    if not header.is_file():
        return None
    text = header.read_text()
    major = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
    minor = re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text)
    if not (major and minor):
        return None
    return int(major.group(1)), int(minor.group(1))


def installed_include() -> pathlib.Path | None:
    try:
        import jax.ffi

        return pathlib.Path(jax.ffi.include_dir())
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return None


def fetch(version: str, dest: pathlib.Path) -> None:
    """Downloads jaxlib==version (no deps) and extracts only its FFI headers into dest."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"jaxlib=={version}", "--no-deps",
               "--only-binary=:all:", "-d", tmp, "-q", "--retries", "1", "--timeout", "30"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(pathlib.Path(tmp).glob("jaxlib-*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()[-600:]}")
        staging = pathlib.Path(tmp) / "include"
        with zipfile.ZipFile(wheels[0]) as z:
            members = [m for m in z.namelist() if m.startswith(API_PREFIX) and m.endswith(".h")]
            if not members:
                raise RuntimeError(f"{wheels[0].name} has no {API_PREFIX}*.h")
            for m in members:
                out = staging / "xla" / "ffi" / "api" / m[len(API_PREFIX):]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(m))
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), str(dest))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jaxlib", default="0.11.2", help="oldest supported jaxlib")
    p.add_argument("--max-minor", type=int, default=4, help="newest FFI API minor that jaxlib accepts")
    p.add_argument("--cache", required=True, help="directory for the extracted headers")
    p.add_argument("--include", default=os.environ.get("FTHSDP_FFI_INCLUDE", ""),
                   help="use this include directory as is (must declare API <= 0.max-minor)")
    args = p.parse_args()

    def ok(d: pathlib.Path) -> bool:
        v = declared_api(d)
        return v is not None and v[0] == 0 and v[1] <= args.max_minor

    if args.include:
        inc = pathlib.Path(args.include)
        if not ok(inc):
            print(f"fthsdp: {inc} declares XLA FFI API {declared_api(inc)}; need 0.<= {args.max_minor} "
                  f"(jaxlib {args.jaxlib})", file=sys.stderr)
            return 1
        print(inc)
        return 0
    cached = pathlib.Path(args.cache) / args.jaxlib / "include"
    if ok(cached):
        print(cached)
        return 0
    inst = installed_include()
    if inst is not None and ok(inst):
        print(inst)
        return 0
    try:
        fetch(args.jaxlib, cached)
    except RuntimeError as e:
        print(f"fthsdp: the installed jaxlib's FFI headers declare API {declared_api(inst) if inst else None}, "
              f"newer than jaxlib {args.jaxlib} accepts, and fetching jaxlib {args.jaxlib}'s headers failed: {e}\n"
              f"Point FTHSDP_FFI_INCLUDE at a directory holding xla/ffi/api/*.h from jaxlib {args.jaxlib} "
              "(e.g. unzip its wheel), or install jaxlib==" + args.jaxlib + " in the build environment.",
              file=sys.stderr)
        return 1
    if not ok(cached):
        print(f"fthsdp: fetched headers under {cached} declare API {declared_api(cached)}", file=sys.stderr)
        return 1
    print(cached)
    return 0


if __name__ == "__main__":
    sys.exit(main())
