"""Repository rule exposing XLA FFI headers to compile fthsdp's handlers against.

A handler declares the FFI API of the headers it was compiled with, and an
older jaxlib refuses a newer one, so the headers of the OLDEST supported
jaxlib (0.11.2, FFI API 0.4) are preferred, exactly as CMake does:
$FTHSDP_FFI_INCLUDE when set; else the copy CMake's scripts/ffi_headers.py
extracted into the workspace's .cache/jaxlib-ffi/0.11.2/include (the build
itself downloads nothing); else the installed jaxlib's headers (then the
library only loads on that jaxlib or newer, and tests/test_ffi_api_version.py
says so for the CMake build).

Python: $FTHSDP_PYTHON when set (then it is the only one tried, so a wrong
choice is reported rather than silently replaced); otherwise the first of
$PYTHON_BIN_PATH, the repository's own .venv/bin/python, python3 on PATH that
can import jax.
"""

_ENV_VARS = ["FTHSDP_PYTHON", "PYTHON_BIN_PATH", "FTHSDP_FFI_INCLUDE"]
_OLDEST_JAXLIB = "0.11.2"

_PROBE = "import jax.ffi, sys; sys.stdout.write(jax.ffi.include_dir())"

def _candidate_pythons(rctx):
    explicit = rctx.os.environ.get("FTHSDP_PYTHON", "")
    if explicit:
        return [explicit]
    found = []
    if rctx.os.environ.get("PYTHON_BIN_PATH", ""):
        found.append(rctx.os.environ["PYTHON_BIN_PATH"])

    # The workspace root, found through a file every fthsdp checkout has.
    root = rctx.path(Label("//:BUILD.bazel")).dirname
    venv = root.get_child(".venv").get_child("bin").get_child("python")
    if venv.exists:
        found.append(str(venv))
    system = rctx.which("python3")
    if system:
        found.append(str(system))
    return found

def _oldest_headers(rctx):
    explicit = rctx.os.environ.get("FTHSDP_FFI_INCLUDE", "")
    if explicit:
        if not rctx.path(explicit + "/xla/ffi/api/ffi.h").exists:
            fail("fthsdp: FTHSDP_FFI_INCLUDE=%s has no xla/ffi/api/ffi.h" % explicit)
        return explicit
    root = rctx.path(Label("//:BUILD.bazel")).dirname
    cached = root.get_child(".cache").get_child("jaxlib-ffi").get_child(_OLDEST_JAXLIB).get_child("include")
    if cached.get_child("xla").get_child("ffi").get_child("api").get_child("ffi.h").exists:
        return str(cached)
    return None

def _jaxlib_ffi_headers_impl(rctx):
    tried = []
    include_dir = None
    for python in _candidate_pythons(rctx):
        result = rctx.execute([python, "-c", _PROBE], quiet = True)
        if result.return_code == 0 and result.stdout:
            include_dir = result.stdout.strip()
            break
        tried.append("%s: %s" % (python, (result.stderr.strip().splitlines() or ["exit %d" % result.return_code])[-1]))
    if include_dir == None:
        fail(("fthsdp: no Python with jax found (tried: %s). Install jax>=0.11.2 " +
              "(e.g. `make install`) or point FTHSDP_PYTHON at a Python that has it.") %
             ("; ".join(tried) or "none"))

    header = rctx.path(include_dir + "/xla/ffi/api/ffi.h")
    if not header.exists:
        fail("fthsdp: jax.ffi.include_dir() = %s has no xla/ffi/api/ffi.h; reinstall jaxlib" % include_dir)

    # The Python above must have jax (a clear error otherwise); the headers
    # compiled against are the oldest supported jaxlib's when available.
    oldest = _oldest_headers(rctx)
    if oldest != None:
        include_dir = oldest

    rctx.symlink(include_dir, "include")
    rctx.file("BUILD.bazel", _BUILD.format(path = include_dir))

_BUILD = """\
load("@rules_cc//cc:defs.bzl", "cc_library")

# XLA FFI headers from jaxlib at {path}
cc_library(
    name = "headers",
    hdrs = glob(["include/xla/ffi/api/*.h"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)
"""

jaxlib_ffi_headers = repository_rule(
    implementation = _jaxlib_ffi_headers_impl,
    environ = _ENV_VARS + ["PATH"],
    local = True,
    doc = "Exposes jaxlib's XLA FFI headers as @<name>//:headers.",
)
