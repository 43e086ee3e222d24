#!/bin/bash
# Laptop / single machine: torchrun --standalone starts NPROC processes of the same program
# (gloo on CPU, nccl with GPUs); ddp_hpc.env reads torchrun's variables.
#
#   launchers/local_torchrun.sh                      # jobs/demo.yaml on 2 processes
#   NPROC=4 launchers/local_torchrun.sh jobs/demo.yaml train.epochs=2
#
# Logs go to $DDP_HPC_LOG_DIR (default runs/local-torchrun-<time>).
# `python -m ddp_hpc.submit --backend local --nodes N --gpus G ...` does the same with N pretend
# nodes and a job record.
set -eu
CONFIG="${1:-jobs/demo.yaml}"
[ "$#" -gt 0 ] && shift
export DDP_HPC_LOG_DIR="${DDP_HPC_LOG_DIR:-runs/local-torchrun-$(date +%Y%m%d-%H%M%S)}"
exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nnodes=1 \
  --nproc-per-node="${NPROC:-2}" -m ddp_hpc.run "$CONFIG" "$@"
