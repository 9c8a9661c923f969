#!/usr/bin/env bash
# Installs the system packages fthsdp's optional checks use: today only Bazel
# (Debian's bazel-bootstrap), so tests/test_bazel.py can build BUILD.bazel.
#
# Idempotent: does nothing when `bazel` is already on PATH. Never fails the
# caller: a machine without apt (or without root) just gets a message saying
# why Bazel was not installed, and the Bazel test then skips with its reason.
set -u

log() { echo "install_system_deps: $*"; }

if command -v bazel >/dev/null 2>&1; then
  log "bazel already present ($(command -v bazel)); nothing to do"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  log "apt-get not found; skipping bazel (install Bazel >= 4.2 by hand to run the Bazel test)"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    log "not root and no passwordless sudo; skipping bazel (run: apt-get install bazel-bootstrap)"
    exit 0
  fi
fi

export DEBIAN_FRONTEND=noninteractive
updated=0
apt_update() {
  updated=1
  $SUDO apt-get update -q || { log "apt-get update failed"; return 1; }
}
install_bazel() {
  $SUDO apt-get install -y -q --no-install-recommends bazel-bootstrap
}

# Refresh the package lists once: up front when the package is unknown, or
# after a failed install (stale lists point at files the mirror no longer has).
if ! apt-cache show bazel-bootstrap >/dev/null 2>&1; then
  apt_update || { log "skipping bazel (the Bazel test will skip)"; exit 0; }
fi
if ! install_bazel; then
  if [ "$updated" -eq 0 ] && apt_update && install_bazel; then
    :
  else
    log "apt-get install bazel-bootstrap failed; skipping bazel (the Bazel test will skip)"
    exit 0
  fi
fi

if command -v bazel >/dev/null 2>&1; then
  log "installed $(bazel --version 2>/dev/null | head -1)"
else
  log "bazel-bootstrap installed but no 'bazel' on PATH; the Bazel test will skip"
fi
exit 0
