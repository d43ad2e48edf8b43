import sys

from pserver.cli import main

sys.exit(main())
