"""ddp_hpc: PyTorch DDP from a laptop to many Slurm GPU nodes.

Data flow (see docs/architecture.md): config -> submit -> env -> dist -> data -> train -> run logs -> status.
"""

__version__ = "0.1.0"
