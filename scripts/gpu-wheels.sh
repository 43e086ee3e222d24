#!/usr/bin/env bash
# On a machine with internet access (a login node), download the wheels scripts/gpu-check.sh needs
# on a GPU node that cannot reach a package index into .whl/, and keep .whl/ out of git
# (.git/info/exclude). .whl/ travels with the checkout (a shared filesystem, or copy it to the
# node); scripts/gpu-check.sh installs it there into a private folder (docs/gpu.md).
#
#   bash scripts/gpu-wheels.sh [NAME==VERSION ...]    # default: submitit and lmdb, pinned as in CI
#
# Versions come from requirements-ci.txt. --no-deps: name every package the node lacks (submitit
# needs cloudpickle and typing_extensions). The wheels are for x86-64 Linux and CPython
# $PY_VERSION (default 3.12): set it to the GPU node's Python, e.g. PY_VERSION=3.11.
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
