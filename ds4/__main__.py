"""`python3 -m ds4`: the `ds4` command (make-tiny, generate, statechart)."""

import sys

from ds4.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
