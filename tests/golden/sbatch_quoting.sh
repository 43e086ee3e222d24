#!/bin/bash
# ddp_hpc job demo: 2 node(s) x 2 task(s), one task per GPU.
# Rendered by ddp_hpc.submit (sbatch backend); `sbatch <this file>` submits it again.
#SBATCH --job-name=demo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-node=2
#SBATCH --cpus-per-task=3
#SBATCH --time=00:30:00
#SBATCH --signal=USR2@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=/work/runs/demo-1/slurm-%j.out

set -eu
# srun does not inherit --cpus-per-task since Slurm 22.05
export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-3}"
# one OpenMP thread per CPU of a task unless set: torch would start one per core in every rank
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$SRUN_CPUS_PER_TASK}"
cd '/work/my dir'
ARGS=(/venv/bin/python -m ddp_hpc.run '/work/my dir/it'"'"'s.yaml' 'name=$(touch /tmp/pwned)' 'log.dir=`id`; rm -rf x' 'model.name="a b"')
LOG_DIR=/work/runs/demo-1
export DDP_HPC_LOG_DIR="$LOG_DIR"
mkdir -p "$LOG_DIR"
echo "ddp_hpc: job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-?}, logs in $LOG_DIR"
# a restart placed on a node that failed an earlier run requeues itself off it (exit 75)
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
  rc=0; /venv/bin/python -m ddp_hpc.supervise.avoid "$LOG_DIR" || rc=$?
  if [ "$rc" = 75 ]; then exit 0; fi
fi
exec srun --kill-on-bad-exit=1 --open-mode=append --output="$LOG_DIR/rank%t.out" "${ARGS[@]}"
