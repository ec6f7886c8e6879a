"""`python -m dhpo_trl.evaluation`: see `dhpo_trl.evaluation.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
