import sys

from ddp_hpc.env.cli import main

sys.exit(main())
