import sys

from ddp_hpc.supervise.cli import main

sys.exit(main())
