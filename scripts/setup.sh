#!/usr/bin/env bash
# Create .venv with the pinned packages and install ddp_hpc into it (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import ddp_hpc, torch, submitit, lmdb, xxhash, pytest" 2>/dev/null \
   || [ ! -x .venv/bin/ddp-hpc ] || [ requirements-ci.txt -nt .venv/.installed ] \
   || [ setup.cfg -nt .venv/.installed ]; then
  .venv/bin/pip install -q --disable-pip-version-check -r requirements-ci.txt
  .venv/bin/pip install -q --disable-pip-version-check --no-deps -e .
  touch .venv/.installed
fi
