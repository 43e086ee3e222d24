"""``python -m ddp_hpc.data``: the same command as ``ddp-hpc data`` (see :mod:`ddp_hpc.data.cli`)."""
import sys

from ddp_hpc.data.cli import main

if __name__ == "__main__":
    sys.exit(main())
