#!/usr/bin/env bash
# Installs the side-by-side all-reduce peers of experiments/ftar_bandwidth.py:
# a Python 3.11 side environment with torch (CPU wheel, for Gloo) and mpi4py,
# and OpenMPI from Debian. torch stays out of the project's 3.12 venv (the
# registry's torch would pull GBs of CUDA). Safe to re-run.
set -euo pipefail
# Default location: the user's cache directory (override with FTHSDP_PEERS_ENV).
PEERS=${FTHSDP_PEERS_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/fthsdp/peers311}
# A Python 3.11 (the CPU torch wheel is for 3.11): $PY311, else python3.11 on
# PATH, else pyenv's newest 3.11.
if [ -z "${PY311:-}" ]; then
  PY311=$(command -v python3.11 || true)
  if [ -z "$PY311" ] && command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare | grep -E '^3\.11(\.|$)' | sort -V | tail -1 || true)
    [ -n "$v" ] && PY311="$(pyenv root)/versions/$v/bin/python"
  fi
  if [ -z "$PY311" ] && [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    PY311=/usr/bin/python3
  fi
fi
if [ -z "${PY311:-}" ]; then
  echo "setup_peers: needs a Python 3.11 (set PY311=/path/to/python3.11)" >&2
  exit 1
fi
mkdir -p "$(dirname "$PEERS")"
echo "setup_peers: side environment $PEERS (python $PY311)"
if ! command -v mpirun >/dev/null; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y openmpi-bin libopenmpi-dev
fi
[ -x "$PEERS/bin/python" ] || "$PY311" -m venv "$PEERS"
"$PEERS/bin/pip" install -q torch==2.13.0 numpy mpi4py
"$PEERS/bin/python" -c "import torch.distributed as d, mpi4py.MPI; print('peers ok: gloo', d.is_gloo_available())"
