"""``python -m mlp_fuser``: see ``mlp_fuser.cli``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
