import sys

from ddp_hpc.submit.cli import main

sys.exit(main())
