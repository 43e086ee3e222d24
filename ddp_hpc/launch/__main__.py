import sys

from ddp_hpc.launch.cli import main

sys.exit(main())
