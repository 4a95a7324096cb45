import sys

from mtp_runtime.cli import main

sys.exit(main())
