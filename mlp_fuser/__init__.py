"""mlp_fuser: find the MLP blocks of transformer models and run each as one fused op."""

__version__ = "0.1.0"

from . import ops  # noqa: F401  (registers the mlp_fuser:: op family)
from .activations import ACTIVATIONS, get_activation  # noqa: F401
from .ops import gated_mlp, mlp  # noqa: F401


def _register_backend() -> None:
    """Make ``torch.compile(model, backend="mlp_fuser")`` work."""
    import torch._dynamo

    try:
        torch._dynamo.register_backend(backend, name="mlp_fuser")
    except Exception:  # already registered (module reloaded)
        pass


from .backend import backend, make_backend  # noqa: E402, F401
from .explain import explain  # noqa: E402, F401
from .patch import is_patched, merge_gate_up, patch, split_gate_up, unpatch  # noqa: E402, F401

_register_backend()

__all__ = [
    "ACTIVATIONS", "__version__", "backend", "explain", "gated_mlp", "get_activation", "is_patched", "make_backend",
    "merge_gate_up", "mlp", "patch", "split_gate_up", "unpatch",
]
