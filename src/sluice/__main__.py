"""Run the command line: ``python -m sluice`` is ``sluice``."""

import sys

from sluice.cli import main

sys.exit(main())
