#!/usr/bin/env bash
# Installs the Debian packages fthsdp's tests and tools use. Each package is
# listed once in PACKAGES with the reason it is needed; add new ones there.
#
# Idempotent: installs only what is missing. Never fails the caller: a machine
# without apt (or without root) gets a message saying what was not installed,
# and the tests that need it skip with their reason.
set -u

# package -> command (or file) that shows it is present, and why we need it
PACKAGES=(
  "clang:clang++"                    # ffi/fuzz/: libFuzzer harnesses are compiled with clang++ (experiments/fuzz.py)
  "libfuzzer-14-dev:/usr/lib/llvm-14/lib/libFuzzer.a"  # ... -fsanitize=fuzzer (tests/test_fuzz.py skips without it)
  "libclang-rt-14-dev:/usr/lib/llvm-14/lib/clang/14.0.6/lib/linux/libclang_rt.asan-x86_64.a"  # ... AddressSanitizer/UBSan runtime
  "bazel-bootstrap:bazel"            # tests/test_bazel.py builds BUILD.bazel offline
  "prometheus:prometheus"            # tests/test_observe_metrics.py scrapes a running job with a real Prometheus
  "chromium:chromium"                # tests/test_observe_dashboard.py drives the dashboard in headless Chromium
  "chromium-driver:chromedriver"     # ... through selenium's WebDriver
)

log() { echo "install_system_deps: $*"; }

missing=()
for entry in "${PACKAGES[@]}"; do
  pkg="${entry%%:*}"; probe="${entry#*:}"
  if [[ "$probe" == /* ]]; then [ -e "$probe" ] && continue
  else command -v "$probe" >/dev/null 2>&1 && continue; fi
  missing+=("$pkg")
done
if [ "${#missing[@]}" -eq 0 ]; then
  log "all present; nothing to do"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  log "apt-get not found; not installed: ${missing[*]} (the tests that need them will skip)"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    log "not root and no passwordless sudo; run: apt-get install ${missing[*]}"
    exit 0
  fi
fi

export DEBIAN_FRONTEND=noninteractive
install_missing() { $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"; }

# Refresh the package lists when a package is unknown, or after a failed
# install (stale lists point at files the mirror no longer has).
updated=0
for pkg in "${missing[@]}"; do
  if ! apt-cache show "$pkg" >/dev/null 2>&1; then
    $SUDO apt-get update -q || log "apt-get update failed"
    updated=1
    break
  fi
done
if ! install_missing; then
  if [ "$updated" -eq 0 ]; then $SUDO apt-get update -q || true; fi
  if ! install_missing; then
    # One by one, so one unavailable package does not cost the others.
    for pkg in "${missing[@]}"; do
      $SUDO apt-get install -y -q --no-install-recommends "$pkg" || log "could not install $pkg (its tests will skip)"
    done
  fi
fi
log "done: ${missing[*]}"
exit 0
