import sys

from ddp_hpc.env.core import main

sys.exit(main())
