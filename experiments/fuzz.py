"""Fuzz every parser a peer or a stranger can reach, for a fixed number of executions.

    python experiments/fuzz.py [--quick] --out results/fuzz.json [--only NAME ...]

Harnesses:

* libFuzzer (C++, clang++ with AddressSanitizer and UBSan, built here from
  ``ffi/fuzz/*.cc`` into ``build/fuzz/``): FTAR's handshake hello, the reply,
  the chunk header (``ffi/transport/wire.h``), the ring schedule's arguments
  (``ffi/ring_schedule.h``) and the ``host:port`` parser. >= 1M executions
  each in the full form.
* atheris (Python): a real in-process lighthouse fed arbitrary request bodies
  and field values (``experiments/fuzz_lighthouse.py``), and the peer server's
  URL and header parsing, alone and behind a real server
  (``experiments/fuzz_peer_server.py``).

Each harness runs with a fixed seed and run count, so a result is reproducible.
The JSON has a list ``harnesses``, each with ``name``, ``executions``,
``coverage`` (libFuzzer's ``cov:``: edges for C++, Python branches for
atheris), ``crashes`` (inputs that crashed, tripped a sanitizer or a property
check; each saved under ``<out>_artifacts/``), ``sanitizer_reports``, and what
the harness recorded (for the lighthouse: which gRPC status codes came back).
A harness whose toolchain is missing (no clang/libFuzzer, no atheris) is listed
with ``skipped`` and the reason, never a crash of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
BUILD = REPO / "build" / "fuzz"
CXX_SOURCES = ("ffi/transport/wire.cc", "ffi/ring_schedule.cc", "ffi/crypto/hmac_sha256.cc")
CXX_HEADERS = ("ffi/transport/wire.h", "ffi/transport/tcp.h", "ffi/ring_schedule.h", "ffi/fuzz/fuzz_check.h",
               "ffi/crypto/hmac_sha256.h")
CXX_FLAGS = ("-std=c++17", "-g", "-O1", "-fno-omit-frame-pointer", "-fsanitize=fuzzer,address,undefined",
             "-fno-sanitize-recover=all")

HELLO_MAGIC, CHUNK_MAGIC, PROOF_MAGIC, VERSION = 0x46544152, 0x4348554E, 0x50524F46, 2


@dataclass(frozen=True)
class Harness:
    name: str
    kind: str  # "libfuzzer" (C++) or "atheris" (Python)
    source: str  # relative to the repository
    runs: int  # full form
    quick_runs: int
    max_len: int = 4096
    what: str = ""
    seeds: tuple[bytes, ...] = ()
    dictionary: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()  # more libFuzzer flags


def _hello(job: bytes = b"job", quorum: int = 7, rank: int = 0, n: int = 2, stream: int = 0, streams: int = 1,
           auth: int = 1) -> bytes:
    return struct.pack("<IIqiiii64sI16s", HELLO_MAGIC, VERSION, quorum, rank, n, stream, streams, job, auth,
                       bytes(range(16)))


def _reply(ok: int = 1, reason: bytes = b"") -> bytes:
    return struct.pack("<I192s16s32s", ok, reason, bytes(16), bytes(32))


def _proof() -> bytes:
    return struct.pack("<I32s", PROOF_MAGIC, bytes(32))


def _chunk(lane: int = 0, op: int = 0, index: int = 0, nbytes: int = 0) -> bytes:
    return struct.pack("<IIQqQ16s", CHUNK_MAGIC, lane, op, index, nbytes, bytes(16))


HARNESSES: tuple[Harness, ...] = (
    Harness("ftar_hello", "libfuzzer", "ffi/fuzz/fuzz_hello.cc", 1_000_000, 20_000,
            what="FTAR handshake hello judged by the receiving rank (wire::check_hello)",
            seeds=(_hello() + bytes(32), _hello(b"j", 3, 1, 4, 1, 2) + bytes(range(40)))),
    Harness("ftar_reply", "libfuzzer", "ffi/fuzz/fuzz_reply.cc", 1_000_000, 20_000,
            what="handshake reply read by the connecting rank (wire::read_reply)",
            seeds=(_reply(1), _reply(0, b"refused: reason") + b"\x01why", _reply(2))),
    Harness("ftar_proof", "libfuzzer", "ffi/fuzz/fuzz_proof.cc", 1_000_000, 20_000,
            what="challenge-response and chunk tags (wire::check_challenge, check_proof, check_chunk_tag)",
            seeds=(_hello() + _reply(2) + _proof() + _chunk() + bytes([0x87]) + b"\x10key" + bytes(40),
                   _hello(b"j", 3, 1, 4, 1, 2) + _reply(0) + _proof() + _chunk(1, 2, 3, 16) + bytes(range(60)))),
    Harness("ftar_chunk_header", "libfuzzer", "ffi/fuzz/fuzz_chunk_header.cc", 1_000_000, 20_000,
            what="chunk header checked against the receiver's schedule (wire::check_chunk_header)",
            seeds=(_chunk() + bytes(48), _chunk(1, 2, 3, 16) + bytes(range(48)))),
    Harness("ring_schedule_args", "libfuzzer", "ffi/fuzz/fuzz_ring_schedule.cc", 1_000_000, 20_000,
            what="RingSchedule constructor arguments over their whole ranges, and sampled lane steps",
            seeds=(struct.pack("<qqiii", 1000, 16, 2, 3, 1) + bytes(64),)),
    Harness("ftar_address", "libfuzzer", "ffi/fuzz/fuzz_address.cc", 1_000_000, 20_000, max_len=256,
            what="host:port of a ring member (wire::split_host_port)",
            seeds=(b"127.0.0.1:29500", b"localhost:0", b"[::1]:80")),
    Harness("lighthouse_requests", "atheris", "experiments/fuzz_lighthouse.py", 3_000, 150, max_len=1024,
            what="a real in-process lighthouse (gRPC) fed arbitrary bodies and field values",
            extra_args=("-len_control=0",)),  # long inputs from the start: structured requests need bytes
    Harness("peer_server_parsing", "atheris", "experiments/fuzz_peer_server.py", 100_000, 3_000, max_len=512,
            what="peer server request heads, URL routing and signed Authorization, alone and behind a real server",
            dictionary=("/v1/manifest", "/v1/snapshot/", "/leaf/", "/piece/", "/manifest", "Bearer ",
                        "FTHSDP-HMAC-SHA256 ", "ts=", ",nonce=", ",mac=", "Host: ", "Content-Length: ",
                        "Transfer-Encoding: ", "?", "%00", " HTTP/1.1", " HTTP/0.9", "\r\n", "\r\n\r\n"),
            extra_args=("-len_control=0",)),
)


# -- toolchain --------------------------------------------------------------------------------


def find_clangxx() -> str | None:
    for name in ("clang++", "clang++-14", "clang++-15", "clang++-16"):
        path = shutil.which(name)
        if path:
            return path
    return None


_PROBE = 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n'


def libfuzzer_problem(clangxx: str | None) -> str | None:
    """Why libFuzzer harnesses cannot be built here (None: they can)."""
    if clangxx is None:
        return "clang++ not found (Debian: apt-get install clang libfuzzer-14-dev; see scripts/install_system_deps.sh)"
    with tempfile.TemporaryDirectory() as d:
        src = pathlib.Path(d) / "probe.cc"
        src.write_text(_PROBE)
        r = subprocess.run([clangxx, *CXX_FLAGS, str(src), "-o", str(pathlib.Path(d) / "probe")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return ("clang++ cannot link -fsanitize=fuzzer,address,undefined (install libfuzzer-14-dev and "
                    f"the sanitizer runtime): {r.stderr.strip()[-300:]}")
    return None


def atheris_problem() -> str | None:
    r = subprocess.run([sys.executable, "-c", "import atheris"], capture_output=True, text=True)
    if r.returncode != 0:
        return "atheris is not installed (pip install atheris; it is in the 'test' extra)"
    return None


def build(h: Harness, clangxx: str) -> pathlib.Path:
    """Compiles a C++ harness into build/fuzz/ unless the binary is newer than every input."""
    BUILD.mkdir(parents=True, exist_ok=True)
    out = BUILD / pathlib.Path(h.source).stem
    inputs = [REPO / h.source, *(REPO / s for s in CXX_SOURCES), *(REPO / s for s in CXX_HEADERS)]
    if out.exists() and out.stat().st_mtime > max(p.stat().st_mtime for p in inputs):
        return out
    cmd = [clangxx, *CXX_FLAGS, f"-I{REPO / 'ffi'}", str(REPO / h.source),
           *(str(REPO / s) for s in CXX_SOURCES), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"building {h.source} failed:\n{r.stderr[-3000:]}")
    return out


# -- running and reading libFuzzer ----------------------------------------------------------------

_SANITIZER = re.compile(r"ERROR: (AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer)|runtime error: ")
_COV = re.compile(r"\bcov: (\d+)")
_FT = re.compile(r"\bft: (\d+)")
_STAT = re.compile(r"^stat::(\w+):\s+(\d+)", re.M)
_ARTIFACT_PREFIXES = ("crash-", "leak-", "timeout-", "oom-")


@dataclass
class Result:
    name: str
    kind: str
    what: str
    executions: int = 0
    coverage: int = 0
    features: int = 0
    crashes: int = 0
    sanitizer_reports: int = 0
    property_failures: int = 0
    seconds: float = 0.0
    requested_runs: int = 0
    seed: int = 0
    exit_code: int | None = None
    first_error: str = ""
    artifacts: list[str] = field(default_factory=list)
    recorded: dict = field(default_factory=dict)
    skipped: str = ""


def read_libfuzzer(output: str, artifacts: list[str], exit_code: int, result: Result) -> Result:
    """Fills `result` from a libFuzzer run's output (the same format for C++ and atheris)."""
    stats = {k: int(v) for k, v in _STAT.findall(output)}
    result.executions = stats.get("number_of_executed_units", 0)
    if not result.executions:
        done = re.findall(r"^Done (\d+) runs", output, re.M)
        result.executions = int(done[-1]) if done else 0
    covs, fts = _COV.findall(output), _FT.findall(output)
    result.coverage = int(covs[-1]) if covs else 0
    result.features = int(fts[-1]) if fts else 0
    result.sanitizer_reports = len(_SANITIZER.findall(output))
    result.property_failures = output.count("FUZZ_CHECK failed") + output.count("=== Uncaught Python exception")
    result.artifacts = sorted(artifacts)
    result.exit_code = exit_code
    result.crashes = len(artifacts)
    if exit_code != 0 and not artifacts:
        result.crashes = 1  # died without saving the input (e.g. killed): still a failure
    for line in output.splitlines():
        if (_SANITIZER.search(line) or "FUZZ_CHECK failed" in line or "Uncaught Python exception" in line
                or "ERROR: libFuzzer" in line or line.startswith(("AssertionError", "Traceback"))):
            result.first_error = line.strip()[:500]
            break
    return result


def _dict_escape(token: str) -> str:
    """A libFuzzer dictionary entry: printable ASCII as is, everything else as \\xNN."""
    return "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else f"\\x{b:02X}"
                   for c in token for b in c.encode("utf-8"))


def run_fuzzer(cmd: list[str], result: Result, runs: int, seed: int, max_len: int, seeds=(), dictionary=(),
               env: dict | None = None, timeout_s: float = 3600, keep: pathlib.Path | None = None,
               extra_args: tuple[str, ...] = ()) -> Result:
    """Runs one libFuzzer-driven binary or script for `runs` executions from a fresh corpus."""
    with tempfile.TemporaryDirectory(prefix="fthsdp-fuzz-") as d:
        work = pathlib.Path(d)
        corpus, arts = work / "corpus", work / "artifacts"
        corpus.mkdir()
        arts.mkdir()
        for i, s in enumerate(seeds):
            (corpus / f"seed-{i}").write_bytes(s)
        args = [f"-runs={runs}", f"-seed={seed}", f"-max_len={max_len}", "-print_final_stats=1",
                f"-artifact_prefix={arts}/", "-timeout=30", "-rss_limit_mb=4096", *extra_args]
        if dictionary:
            dict_file = work / "tokens.dict"
            dict_file.write_text("".join(f'"{_dict_escape(t)}"\n' for t in dictionary))
            args.append(f"-dict={dict_file}")
        t0 = time.monotonic()
        try:
            p = subprocess.run([*cmd, *args, str(corpus)], cwd=work, capture_output=True, text=True,
                               errors="replace", env={**os.environ, **(env or {})}, timeout=timeout_s)
            output, code = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            def text(x) -> str:  # TimeoutExpired carries bytes even with text=True
                return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")

            output = text(e.stdout) + text(e.stderr)
            output += f"\nfuzz.py: the harness ran past {timeout_s:.0f} s and was killed"
            code = -9
        result.seconds = time.monotonic() - t0
        result.requested_runs, result.seed = runs, seed
        found = [a.name for a in arts.iterdir() if a.name.startswith(_ARTIFACT_PREFIXES)]
        if found and keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for a in found:
                shutil.copy(arts / a, keep / f"{result.name}-{a}")
        read_libfuzzer(output, found, code, result)
        if code != 0 and not result.first_error:
            result.first_error = output.strip().splitlines()[-1][:500] if output.strip() else f"exit code {code}"
    return result


REGRESSIONS = REPO / "ffi" / "fuzz" / "regressions"


def starting_corpus(h: Harness) -> tuple[bytes, ...]:
    """The harness's seeds plus every input that once crashed it (replayed first on every run)."""
    d = REGRESSIONS / h.name
    saved = tuple(f.read_bytes() for f in sorted(d.iterdir()) if f.is_file()) if d.is_dir() else ()
    return h.seeds + saved


def run_harness(h: Harness, quick: bool, seed: int, keep: pathlib.Path | None, clangxx: str | None,
                cxx_problem: str | None, py_problem: str | None, cxx_runs: int | None = None) -> Result:
    result = Result(h.name, h.kind, h.what)
    runs = h.quick_runs if quick else h.runs
    if cxx_runs is not None and h.kind == "libfuzzer":
        runs = cxx_runs
    if h.kind == "libfuzzer":
        if cxx_problem:
            result.skipped = cxx_problem
            return result
        binary = build(h, clangxx)
        return run_fuzzer([str(binary)], result, runs, seed, h.max_len, starting_corpus(h), h.dictionary, keep=keep,
                          extra_args=h.extra_args)
    if py_problem:
        result.skipped = py_problem
        return result
    with tempfile.TemporaryDirectory(prefix="fthsdp-fuzz-stats-") as d:
        stats = pathlib.Path(d) / "stats.json"
        env = {"FTHSDP_FUZZ_RUNS": str(runs), "FTHSDP_FUZZ_STATS": str(stats)}
        run_fuzzer([sys.executable, str(REPO / h.source)], result, runs, seed, h.max_len, starting_corpus(h), h.dictionary,
                   env=env, keep=keep, extra_args=h.extra_args)
        if stats.exists():
            result.recorded = json.loads(stats.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short form for CI (20k executions per C++ harness)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help=f"run only these harnesses: {', '.join(h.name for h in HARNESSES)}")
    p.add_argument("--seed", type=int, default=1, help="libFuzzer's -seed (default 1)")
    p.add_argument("--cxx-runs", type=int, default=None, metavar="N",
                   help="executions per C++ harness instead of the form's default (1M full, 20k quick)")
    args = p.parse_args(argv)
    names = {h.name for h in HARNESSES}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        p.error(f"unknown harness {unknown}; choose from {', '.join(sorted(names))}")
    chosen = [h for h in HARNESSES if args.only is None or h.name in args.only]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    keep = out.with_name(out.stem + "_artifacts")
    clangxx = find_clangxx()
    cxx_problem = libfuzzer_problem(clangxx) if any(h.kind == "libfuzzer" for h in chosen) else None
    py_problem = atheris_problem() if any(h.kind == "atheris" for h in chosen) else None
    results = []
    for h in chosen:
        r = run_harness(h, args.quick, args.seed, keep, clangxx, cxx_problem, py_problem, args.cxx_runs)
        results.append(r)
        state = f"skipped: {r.skipped}" if r.skipped else (
            f"{r.executions} executions, cov {r.coverage}, {r.crashes} crashes, {r.sanitizer_reports} sanitizer "
            f"reports, {r.seconds:.1f} s" + (f"; first error: {r.first_error}" if r.first_error else ""))
        print(f"fuzz: {h.name}: {state}", flush=True)
    ran = [r for r in results if not r.skipped]
    doc = {
        "quick": args.quick,
        "seed": args.seed,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "clang++": clangxx},
        "harnesses": [vars(r) for r in results],
        "summary": {
            "ran": len(ran),
            "skipped": len(results) - len(ran),
            "crashes": sum(r.crashes for r in ran),
            "sanitizer_reports": sum(r.sanitizer_reports for r in ran),
            "cxx_min_executions": min((r.executions for r in ran if r.kind == "libfuzzer"), default=0),
        },
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"fuzz: wrote {out}: {doc['summary']}")
    return 1 if doc["summary"]["crashes"] or doc["summary"]["sanitizer_reports"] else 0


if __name__ == "__main__":
    sys.exit(main())
