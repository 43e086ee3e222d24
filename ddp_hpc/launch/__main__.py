import sys

from ddp_hpc.launch.core import main

sys.exit(main())
