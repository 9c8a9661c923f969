#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 interpreter, installing 3.12 with pyenv
# when the machine has pyenv but no such interpreter. Exits 1 with a reason otherwise.
set -euo pipefail
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
for cand in "${PYTHON:-}" python3.12 python3.13 python3; do
  [ -n "$cand" ] || continue
  p=$(command -v "$cand" 2>/dev/null) || continue
  # pyenv shims exist for versions that are not active; ask the shim to run.
  if ok "$p"; then echo "$p"; exit 0; fi
done
for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
  if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1; then
  echo "fthsdp: no Python >= 3.12 found; installing 3.12 with pyenv" >&2
  pyenv install -s 3.12 >&2
  p="$(pyenv root)/versions/$(pyenv latest 3.12)/bin/python3"
  if ok "$p"; then echo "$p"; exit 0; fi
fi
echo "fthsdp: needs Python >= 3.12 (jax >= 0.11 does); install it (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12" >&2
exit 1
