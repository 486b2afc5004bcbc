"""mlp_fuser: find the MLP blocks of transformer models and run each as one fused op."""

__version__ = "0.1.0"

from . import compat, config  # noqa: F401  (config, compat as attributes)
from .activations import ACTIVATIONS, get_activation  # noqa: F401
from .ops import quant, quant_moe  # noqa: F401  (register the quant_* ops)
from .ops.dense import gated_mlp, mlp  # noqa: F401
from .ops.moe import moe_mlp  # noqa: F401
from .ops.router import moe_router_topk  # noqa: F401


def _register_backend() -> None:
    """Make ``torch.compile(model, backend="mlp_fuser")`` work."""
    try:
        compat.register_backend(backend, "mlp_fuser")
    except Exception:  # already registered (module reloaded)
        pass


from .explain import explain  # noqa: E402, F401
from .graph.backend import backend, make_backend  # noqa: E402, F401
from .patch import hf  # noqa: E402
from .patch.api import is_patched, merge_gate_up, patch, split_gate_up, unpatch  # noqa: E402, F401

_register_backend()
hf.install()  # transformers' experts implementation "mlp_fuser", registered once transformers loads its MoE code

__all__ = [
    "ACTIVATIONS", "__version__", "backend", "config", "explain", "gated_mlp", "get_activation", "is_patched",
    "make_backend", "merge_gate_up", "mlp", "moe_mlp", "moe_router_topk", "patch", "split_gate_up", "unpatch",
]
