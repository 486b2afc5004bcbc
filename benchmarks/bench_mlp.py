"""The MLP benchmark lives in the package (``python -m mlp_fuser bench``); this script runs the same thing."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlp_fuser.bench import L2_BYTES, MS, SHAPES, main, make_weights  # noqa: E402, F401

if __name__ == "__main__":
    sys.exit(main())
