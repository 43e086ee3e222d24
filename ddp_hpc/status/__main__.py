import sys

from ddp_hpc.status.cli import main

sys.exit(main())
