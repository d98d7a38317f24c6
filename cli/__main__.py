"""`python -m sparrow.cli ...`: the `sparrow` command (main.py)."""

import sys

from sparrow.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
