#!/usr/bin/env bash
# Everything the first session on a GPU host must run, in order, from the
# repository root:
#   1. build from source against the installed jax (the CUDA library too) and
#      check that libfthsdp_cuda.so was built, loads and registers;
#   2. pytest -m gpu: the GPU tests, which must RUN here (a skip is a failure);
#   3. the rest of the suite (pytest -m "not gpu"): the CPU suite on a host
#      whose default jax backend is a GPU;
#   4. experiments/ftar_gpu.py --out results/ftar_gpu.json, then its table.
# Stops at the first failing stage and says which. Logs go to $LOGS
# (default: a new temporary directory, printed first).
#
#   bash scripts/gpu_check.sh            # all four stages
#   QUICK=1 bash scripts/gpu_check.sh    # the benchmark with --quick
#   SKIP_SUITE=1 bash scripts/gpu_check.sh   # stage 3 left out (it is the long one)
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#   TEST_TIMEOUT=120 GROUP_TIMEOUT=60 bash scripts/gpu_check.sh   # bound each GPU test and
#                                        # each benchmark group (a short lease: a hang costs
#                                        # its timeout, not the lease); defaults 300 and 900 s
#   OFFLINE=1 bash scripts/gpu_check.sh  # a host with no package index: install fthsdp
#                                        # alone (--no-deps --no-index); its dependencies
#                                        # must already be there (or on PYTHONPATH)
#
# Needs: nvcc, and a Python with jax[cuda] >= 0.11.2, scikit-build-core,
# nanobind, cmake, ninja and grpcio-tools (the build generates the gRPC stubs);
# torch with CUDA for the Gloo baseline and the pinned-copy ceilings (without
# it those rows are recorded as skipped).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
LOGS="${LOGS:-$(mktemp -d -t fthsdp-gpu-check.XXXXXX)}"
mkdir -p "$LOGS" results
echo "gpu_check: logs in $LOGS"

stage() { printf '\n=== %s\n' "$*"; }
die() { printf 'gpu_check: FAILED at %s\n' "$*" >&2; exit 1; }

stage "0. prerequisites ($PYTHON)"
command -v nvcc >/dev/null || die "prerequisites: nvcc not on PATH (the CUDA library would be skipped)"
JAX_PLATFORMS=cuda,cpu "$PYTHON" - <<'EOF' || die "prerequisites: see the message above"
import importlib.util, sys
missing = [m for m in ("jax", "nanobind", "scikit_build_core", "grpc_tools") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {', '.join(missing)} (pip install them, or carry their wheels)")
import jax
try:
    gpus = jax.devices("gpu")
except RuntimeError as e:
    sys.exit(f"jax sees no GPU ({e}): this script is for a GPU host")
print("jax", jax.__version__, "GPUs:", gpus)
EOF

stage "1. build (log: $LOGS/build.log)"
if [[ -n "${OFFLINE:-}" ]]; then install=(--no-deps --no-index -e .); else install=(-e ".[test]"); fi
"$PYTHON" -m pip install --no-build-isolation "${install[@]}" >"$LOGS/build.log" 2>&1 \
  || { tail -40 "$LOGS/build.log"; die "build"; }
JAX_PLATFORMS=cuda,cpu "$PYTHON" - <<'EOF' || die "build: the CUDA library does not load"
from fthsdp.collective import native
path = native.cuda_library_path()
assert path is not None, "libfthsdp_cuda.so was not built (was nvcc found by CMake? see the build log)"
native.ensure_registered()
print("CUDA library:", path, "declared FFI API:", native.declared_api_versions())
EOF

stage "2. pytest -m gpu (log: $LOGS/gpu_tests.log)"
status=0
"$PYTHON" -m pytest -m gpu -v -rs -p no:cacheprovider --timeout "${TEST_TIMEOUT:-300}" tests/ \
  >"$LOGS/gpu_tests.log" 2>&1 || status=$?
tail -30 "$LOGS/gpu_tests.log"
[[ $status -eq 0 ]] || die "pytest -m gpu (exit $status)"
if grep -qE "^SKIPPED" "$LOGS/gpu_tests.log"; then
  die "pytest -m gpu: tests were skipped on a GPU host (see SKIPPED above)"
fi

if [[ -z "${SKIP_SUITE:-}" ]]; then
  stage "3. the rest of the suite, pytest -m 'not gpu' (log: $LOGS/suite.log)"
  "$PYTHON" -m pytest -q -m "not gpu" -p no:cacheprovider tests/ >"$LOGS/suite.log" 2>&1 \
    || { tail -40 "$LOGS/suite.log"; die "the suite"; }
  tail -3 "$LOGS/suite.log"
fi

stage "4. experiments/ftar_gpu.py (log: $LOGS/ftar_gpu.log)"
"$PYTHON" experiments/ftar_gpu.py ${QUICK:+--quick} --group-timeout "${GROUP_TIMEOUT:-900}" \
  --out results/ftar_gpu.json >"$LOGS/ftar_gpu.log" 2>&1 \
  || { tail -40 "$LOGS/ftar_gpu.log"; die "experiments/ftar_gpu.py"; }
"$PYTHON" experiments/ftar_gpu.py --table results/ftar_gpu.json

stage "done: results/ftar_gpu.json (+ .png); put the table above in the README's GPU section"
