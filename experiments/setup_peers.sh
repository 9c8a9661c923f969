#!/usr/bin/env bash
# Installs the side-by-side all-reduce peers of experiments/ftar_bandwidth.py:
# a Python 3.11 side environment with torch (CPU wheel, for Gloo) and mpi4py,
# and OpenMPI from Debian. torch stays out of the project's 3.12 venv (the
# registry's torch would pull GBs of CUDA). Safe to re-run.
set -euo pipefail
PEERS=${FTHSDP_PEERS_ENV:-/work/peers311}
PY311=${PY311:-/root/.pyenv/versions/3.11.7/bin/python}
if ! command -v mpirun >/dev/null; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y openmpi-bin libopenmpi-dev
fi
[ -x "$PEERS/bin/python" ] || "$PY311" -m venv "$PEERS"
"$PEERS/bin/pip" install -q torch==2.13.0 numpy mpi4py
"$PEERS/bin/python" -c "import torch.distributed as d, mpi4py.MPI; print('peers ok: gloo', d.is_gloo_available())"
