"""A real multi-node Slurm cluster on one machine, for tests and for trying ddp_hpc without a cluster.

    python -m ddp_hpc.testcluster install [--slurmdbd]     # apt-get the Debian packages
    python -m ddp_hpc.testcluster up --nodes 4 --gpus-per-node 4 [--slurmdbd]
    export SLURM_CONF=/tmp/ddp_hpc_testcluster/etc/slurm.conf
    srun -N2 --ntasks-per-node=2 hostname
    python -m ddp_hpc.testcluster down
    python -m ddp_hpc.testcluster run --slurmdbd -- CMD ...   # up, CMD, down, holding the lock

Each node gets its own network namespace, address and hostname (``--layout netns``; the
``loopback`` layout runs every slurmd on 127.0.0.1 instead), fake GPUs through GRES, job
completion records (``sacct -c``) and, with ``--slurmdbd``, MariaDB + slurmdbd for plain ``sacct``.
All state lives under one directory (``--state-dir``, default /tmp/ddp_hpc_testcluster).
"""

from .cluster import down, load_state, set_accounting, status, up
from .spec import DEFAULT_STATE_DIR, ClusterError, ClusterSpec

__all__ = ["ClusterError", "ClusterSpec", "DEFAULT_STATE_DIR", "down", "load_state",
           "set_accounting", "status", "up"]
