#!/usr/bin/env bash
# Set up .venv if needed and run the whole test suite (cluster tests need root + slurm-wlm;
# without them they skip with a visible reason).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -ra "$@"
