import sys

from ddp_hpc.exec.wrapper import main

sys.exit(main())
