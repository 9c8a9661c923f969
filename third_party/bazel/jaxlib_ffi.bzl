"""Repository rule exposing the XLA FFI headers that ship with the installed jaxlib.

fthsdp's handlers must be compiled against the exact FFI ABI of the jaxlib that
will load them, so the headers come from the Python environment (the same
`jax.ffi.include_dir()` CMake uses) instead of a pinned download.

Python: $FTHSDP_PYTHON when set (then it is the only one tried, so a wrong
choice is reported rather than silently replaced); otherwise the first of
$PYTHON_BIN_PATH, the repository's own .venv/bin/python, python3 on PATH that
can import jax.
"""

_ENV_VARS = ["FTHSDP_PYTHON", "PYTHON_BIN_PATH"]

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

    rctx.symlink(include_dir, "include")
    rctx.file("BUILD.bazel", """\
load("@rules_cc//cc:defs.bzl", "cc_library")

# XLA FFI headers from jaxlib at {path}
cc_library(
    name = "headers",
    hdrs = glob(["include/xla/ffi/api/*.h"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)
""".format(path = include_dir))

jaxlib_ffi_headers = repository_rule(
    implementation = _jaxlib_ffi_headers_impl,
    environ = _ENV_VARS + ["PATH"],
    local = True,
    doc = "Exposes jaxlib's XLA FFI headers as @<name>//:headers.",
)
