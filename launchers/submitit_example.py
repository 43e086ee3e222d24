"""Use submitit directly, with ddp_hpc's environment layer doing the rank/host/port work.

    python launchers/submitit_example.py --nodes 2 --gpus 2 [--partition P] [--time 30]

Each of the N x G tasks runs `task()`: `ddp_hpc.env.detect()` understands submitit's tasks (it reads
the SLURM_* variables srun sets), `setup_ddp()` exports MASTER_ADDR/PORT/RANK/... (refusing to
silently replace different values) and builds the process group; then your own training code
runs. Here it checks an all_reduce and then trains the demo job through ddp_hpc.run.

`python -m ddp_hpc.submit --backend submitit ...` does all of this for you (plus the
preemption signal, requeue, per-rank logs and a job record); this file shows the moving parts.
"""

from __future__ import annotations

import argparse
import os
import sys


def task(config: str, overrides: list[str], log_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    from ddp_hpc.env import detect

    env = detect()
    print(f"rank {env.rank}/{env.world_size} on node {env.node_rank} ({env.launcher}), "
          f"master {env.master_addr}:{env.master_port}", flush=True)
    ctx = setup_ddp(env=env)
    try:
        t = torch.tensor([float(env.rank)])
        dist.all_reduce(t)
        assert t.item() == env.world_size * (env.world_size - 1) / 2, t.item()
        # The training core reuses this process group. One group per process: destroying it
        # and creating another on the same MASTER_PORT races with peers still tearing down.
        os.environ["DDP_HPC_LOG_DIR"] = log_dir
        from ddp_hpc import run
        rc = run.main([config, *overrides])
    finally:
        cleanup_ddp()
    if rc:
        raise RuntimeError(f"ddp_hpc.run exited with {rc}")
    return {"rank": env.rank, "backend": ctx.backend}


def main() -> int:
    import submitit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2, help="nodes to allocate (default 2)")
    ap.add_argument("--gpus", type=int, default=2,
                    help="GPUs per node = tasks per node (default 2)")
    ap.add_argument("--partition", help="Slurm partition (default: the cluster's default)")
    ap.add_argument("--time", type=int, default=30, help="time limit in minutes (default 30)")
    ap.add_argument("--config", default="jobs/demo.yaml",
                    help="job config to train (default jobs/demo.yaml)")
    ap.add_argument("--folder", default="runs/submitit-example",
                    help="submitit writes to FOLDER/<job id>, the run logs go to FOLDER/logs")
    ap.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                    help="optional config overrides, e.g. train.epochs=2")
    args = ap.parse_args()

    ex = submitit.AutoExecutor(folder=os.path.join(args.folder, "%j"))
    ex.update_parameters(
        nodes=args.nodes, tasks_per_node=args.gpus, gpus_per_node=args.gpus,
        cpus_per_task=2, timeout_min=args.time, name="ddp_hpc_submitit_example",
        slurm_additional_parameters={"requeue": True},
        slurm_srun_args=["--kill-on-bad-exit=1"],     # one dead rank ends the step
        slurm_setup=["export SRUN_CPUS_PER_TASK=2"],  # srun no longer inherits cpus-per-task
    )
    if args.partition:
        ex.update_parameters(slurm_partition=args.partition)
    job = ex.submit(task, os.path.abspath(args.config), args.overrides,
                    os.path.abspath(os.path.join(args.folder, "logs")))
    print(f"submitted {job.job_id}; waiting (logs in {args.folder})", flush=True)
    results = job.results()          # one entry per task
    print("results:", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
