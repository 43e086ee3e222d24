#!/usr/bin/env bash
# Create .venv-bench: the project's pinned packages plus the peer data loaders that
# bench/peers.py compares ddp_hpc's IO cures with (WebDataset, LitData, MosaicML Streaming).
# They stay out of .venv and out of the runtime requirements.  Idempotent.
#
# torch is pinned through a constraints file so that no dependency resolution can swap the CPU
# build of torch 2.13.0 for another build (a CUDA one is several GB).  bench/requirements.txt
# pins the peers and all they need, and goes in with --no-deps: their metadata asks for
# torchvision, whose PyPI wheels are CUDA builds (bench/requirements.txt says why it is left out).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-bench/bin/python ]; then
  python3 -m venv .venv-bench
fi
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"
pip=(.venv-bench/bin/pip install -q --disable-pip-version-check -c "$constraints")
if ! .venv-bench/bin/python -c "import ddp_hpc, torch, webdataset, litdata, importlib.metadata as m; \
                                  m.version('mosaicml-streaming')" 2>/dev/null \
   || [ bench/requirements.txt -nt .venv-bench/.installed ] \
   || [ requirements-ci.txt -nt .venv-bench/.installed ] || [ setup.cfg -nt .venv-bench/.installed ]; then
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" -r requirements-ci.txt
  "${pip[@]}" --no-deps -r bench/requirements.txt
  "${pip[@]}" --no-deps -e .
  touch .venv-bench/.installed
fi
.venv-bench/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
