#!/usr/bin/env bash
# Download the wheels scripts/gpu-check.sh needs on a machine that cannot reach a package index (the
# device machine: Python 3.12, x86-64, PyTorch 2.11 with CUDA, psutil, pyyaml, xxhash, tqdm, pillow
# and pytest already there; submitit and lmdb missing) into .whl/, and keep .whl/ out of git
# (.git/info/exclude). Then carry it: the device tool's run with carry [".whl"] and the command
# `bash scripts/gpu-check.sh` (docs/gpu.md).
#
#   bash scripts/gpu-wheels.sh [NAME==VERSION ...]    # default: submitit and lmdb, pinned as in CI
#
# Versions come from requirements-ci.txt; --no-deps: submitit's own needs (cloudpickle,
# typing_extensions) are on the device machine already. PY_VERSION=3.11 etc. for another Python.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
PY_VERSION=${PY_VERSION:-3.12}
pin() { grep -i "^$1==" requirements-ci.txt | head -1 || echo "$1"; }
PKGS=("$@")
[ ${#PKGS[@]} -gt 0 ] || PKGS=("$(pin submitit)" "$(pin lmdb)")

EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")" "$DEST"
grep -qxF "/$DEST/" "$EXCLUDE" 2>/dev/null || echo "/$DEST/" >> "$EXCLUDE"

PIP=(python3 -m pip)
command -v python3 >/dev/null 2>&1 || PIP=(.venv/bin/python -m pip)
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$DEST" "${PKGS[@]}"
ls -l "$DEST"
du -sh "$DEST"
