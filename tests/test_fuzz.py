"""Fuzzing in CI: the short form of experiments/fuzz.py, and the driver's own bookkeeping.

The libFuzzer harnesses (ffi/fuzz/) need clang++ with libFuzzer and the
sanitizer runtimes, the Python ones need atheris; each test skips with the
reason when its toolchain is missing. The driver is also checked against a
harness with a planted heap overflow, so "0 crashes" is known to mean
something.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fthsdp_fuzz_driver", REPO / "experiments" / "fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fuzz  # dataclasses resolve their module by name
_spec.loader.exec_module(fuzz)

CXX = [h for h in fuzz.HARNESSES if h.kind == "libfuzzer"]
PY = [h for h in fuzz.HARNESSES if h.kind == "atheris"]


@pytest.fixture(scope="module")
def cxx_toolchain() -> str:
    clangxx = fuzz.find_clangxx()
    problem = fuzz.libfuzzer_problem(clangxx)
    if problem:
        pytest.skip(problem)
    return clangxx


@pytest.fixture(scope="module")
def atheris_available() -> None:
    problem = fuzz.atheris_problem()
    if problem:
        pytest.skip(problem)


def _run_driver(tmp_path: pathlib.Path, names: list[str]) -> dict:
    out = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, str(REPO / "experiments" / "fuzz.py"), "--quick", "--out", str(out),
                        "--only", *names], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.exists(), r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert r.returncode == (1 if doc["summary"]["crashes"] or doc["summary"]["sanitizer_reports"] else 0)
    return doc


def _assert_clean(h: dict, runs: int) -> None:
    assert not h["skipped"], h["skipped"]
    assert h["executions"] >= runs, h
    assert h["coverage"] > 0, h
    assert h["crashes"] == 0 and h["sanitizer_reports"] == 0 and h["property_failures"] == 0, (
        f"{h['name']}: {h['first_error']} (inputs saved as {h['artifacts']})")


def test_cxx_harnesses_short_form_find_no_crash_and_no_sanitizer_report(tmp_path, cxx_toolchain):
    doc = _run_driver(tmp_path, [h.name for h in CXX])
    got = {h["name"]: h for h in doc["harnesses"]}
    assert set(got) == {h.name for h in CXX}
    for h in CXX:
        _assert_clean(got[h.name], h.quick_runs)
    assert doc["summary"]["cxx_min_executions"] >= min(h.quick_runs for h in CXX)


def test_python_harnesses_short_form_answer_every_request(tmp_path, atheris_available):
    doc = _run_driver(tmp_path, [h.name for h in PY])
    got = {h["name"]: h for h in doc["harnesses"]}
    for h in PY:
        _assert_clean(got[h.name], h.quick_runs)
    lighthouse = got["lighthouse_requests"]["recorded"]
    codes = lighthouse["status_codes"]
    # Every input got a status code (plus the periodic liveness probes), and both
    # refusals and successes were reached.
    assert sum(codes.values()) >= lighthouse["inputs"] >= PY[0].quick_runs - 2
    assert codes.get("INVALID_ARGUMENT", 0) > 0 and codes.get("OK", 0) > 0, codes
    peer = got["peer_server_parsing"]["recorded"]
    assert peer["http_statuses"].get("200", 0) > 0 and peer["http_statuses"].get("401", 0) > 0, peer
    assert {"manifest", "piece"} <= set(peer["parse_route_results"]), peer


_PLANTED = r"""
#include <cstdlib>
#include <cstring>
extern "C" int LLVMFuzzerTestOneInput(const unsigned char* data, unsigned long size) {
  if (size >= 3 && data[0] == 'F' && data[1] == 'Z' && data[2] == '!') {
    char* p = static_cast<char*>(std::malloc(4));
    std::memset(p, 0, 4);
    volatile char c = p[4 + (size & 3)];  // heap-buffer-overflow: the planted bug
    (void)c;
    std::free(p);
  }
  return 0;
}
"""


def test_driver_counts_a_planted_heap_overflow(tmp_path, cxx_toolchain):
    src = tmp_path / "planted.cc"
    src.write_text(_PLANTED)
    binary = tmp_path / "planted"
    subprocess.run([cxx_toolchain, *fuzz.CXX_FLAGS, str(src), "-o", str(binary)], check=True, timeout=300)
    keep = tmp_path / "kept"
    r = fuzz.run_fuzzer([str(binary)], fuzz.Result("planted", "libfuzzer", "planted bug"), runs=2_000_000, seed=1,
                        max_len=16, seeds=(b"FZ",), keep=keep)
    assert r.crashes == 1 and r.sanitizer_reports >= 1, vars(r)
    assert "AddressSanitizer" in r.first_error and r.exit_code != 0
    saved = list(keep.iterdir())
    assert len(saved) == 1 and saved[0].read_bytes().startswith(b"FZ!")


def test_a_missing_toolchain_is_recorded_as_skipped_not_a_crash():
    assert "clang++ not found" in fuzz.libfuzzer_problem(None)
    h = CXX[0]
    r = fuzz.run_harness(h, quick=True, seed=1, keep=None, clangxx=None, cxx_problem="no clang here",
                         py_problem=None)
    assert r.skipped == "no clang here" and r.executions == 0 and r.crashes == 0


def test_libfuzzer_output_is_read_into_counts():
    output = "\n".join([
        "#2\tINITED cov: 10 ft: 11 corp: 1/1b exec/s: 0 rss: 30Mb",
        "#1000000\tDONE   cov: 264 ft: 1210 corp: 120/4Kb lim: 4096 exec/s: 90000 rss: 60Mb",
        "Done 1000000 runs in 11 second(s)",
        "stat::number_of_executed_units: 1000000",
        "stat::new_units_added:          119",
    ])
    r = fuzz.read_libfuzzer(output, [], 0, fuzz.Result("x", "libfuzzer", ""))
    assert (r.executions, r.coverage, r.features, r.crashes, r.sanitizer_reports) == (1_000_000, 264, 1210, 0, 0)
    bad = output + "\nwire.cc:12:3: runtime error: signed integer overflow\nSUMMARY: UndefinedBehaviorSanitizer"
    r = fuzz.read_libfuzzer(bad, ["crash-abc"], 1, fuzz.Result("x", "libfuzzer", ""))
    assert r.crashes == 1 and r.sanitizer_reports == 1 and "signed integer overflow" in r.first_error
    r = fuzz.read_libfuzzer("killed", [], -9, fuzz.Result("x", "libfuzzer", ""))
    assert r.crashes == 1  # died without saving an input: still counted


def test_inputs_that_once_crashed_are_replayed_on_every_run():
    chunk = next(h for h in CXX if h.name == "ftar_chunk_header")
    corpus = fuzz.starting_corpus(chunk)
    assert len(corpus) > len(chunk.seeds)  # the finished-lane regression is part of every run
    assert all(d.name in {h.name for h in fuzz.HARNESSES} for d in fuzz.REGRESSIONS.iterdir() if d.is_dir())
