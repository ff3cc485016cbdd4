"""The file spark-submit runs for `sluice ... --deploy-mode cluster`: `sluice` itself."""

import sys

from sluice.cli import main

if __name__ == "__main__":
    sys.exit(main())
