#!/bin/bash
# Inside an allocation (salloc, or a batch script of your own): one task per GPU with srun.
#
#   salloc --nodes=2 --ntasks-per-node=2 --gpus-per-node=2 --time=30
#   launchers/srun.sh jobs/demo.yaml train.epochs=2
#
# srun takes the layout of the allocation; --kill-on-bad-exit=1 ends the step when one rank
# dies instead of leaving the others blocked in a collective. Since Slurm 22.05 srun no longer
# inherits --cpus-per-task, so it is passed on through SRUN_CPUS_PER_TASK. Per-rank output goes
# to $DDP_HPC_LOG_DIR/rank<R>.out (default runs/srun-<job id>).
set -eu
if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "launchers/srun.sh: not inside a Slurm allocation (no SLURM_JOB_ID)." >&2
  echo "HINT: run it under salloc or sbatch, or use python -m ddp_hpc.submit to submit a job." >&2
  exit 2
fi
CONFIG="${1:-jobs/demo.yaml}"
[ "$#" -gt 0 ] && shift
export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"
export DDP_HPC_LOG_DIR="${DDP_HPC_LOG_DIR:-runs/srun-${SLURM_JOB_ID}}"
mkdir -p "$DDP_HPC_LOG_DIR"
exec srun --kill-on-bad-exit=1 --open-mode=append --output="$DDP_HPC_LOG_DIR/rank%t.out" \
  "${PYTHON:-python}" -m ddp_hpc.run "$CONFIG" "$@"
