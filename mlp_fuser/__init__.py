"""mlp_fuser: find the MLP blocks of transformer models and run each as one fused op."""

__version__ = "0.1.0"

from . import ops  # noqa: F401  (registers the mlp_fuser:: op family)
from .activations import ACTIVATIONS, get_activation  # noqa: F401
from .ops import gated_mlp, mlp  # noqa: F401
