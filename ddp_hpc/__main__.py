import sys

from ddp_hpc.cli import main

sys.exit(main())
