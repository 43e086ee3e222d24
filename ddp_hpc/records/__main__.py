import sys

from ddp_hpc.records.register import main

sys.exit(main())
