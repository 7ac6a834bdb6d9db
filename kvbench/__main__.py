import sys

from kvbench.cli.main import main

sys.exit(main())
