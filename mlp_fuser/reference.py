"""The aten reference, and the error measure every numerical check uses against it.

CPU (and every device without a Triton kernel) runs ``reference_mlp``, so a patched model on the CPU gives the
same numbers as the unpatched one. It is also the correctness oracle's structure (run in float64 by tests).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .activations import get_activation


def reference_mlp(
    x: Tensor,
    w_gate: Tensor,
    b_gate: Tensor | None,
    w_up: Tensor | None,
    b_up: Tensor | None,
    w_down: Tensor,
    b_down: Tensor | None,
    activation: str,
) -> Tensor:
    """``down(act(gate(x)) * up(x))``, or ``down(act(gate(x)))`` when ``w_up`` is None. Weights are (out, in)."""
    act = get_activation(activation).fn
    h = act(F.linear(x, w_gate, b_gate))
    if w_up is not None:
        h = h * F.linear(x, w_up, b_up)
    return F.linear(h, w_down, b_down)


def rel_err(out: Tensor, ref: Tensor, ord: float = 2) -> float:
    """``‖out − ref‖ / ‖ref‖`` over all elements, in float64; ``‖out − ref‖`` when ``ref`` is all zeros.

    ``ord=2``: the Euclidean norm; ``ord=math.inf``: the largest absolute difference over the largest ``|ref|``.
    NaN when ``out`` or ``ref`` holds a NaN or an infinity, so that no bar (``err <= bar``) passes it.
    """
    out, ref = out.double(), ref.double()
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return math.nan
    diff = torch.linalg.vector_norm(out - ref, ord).item()
    den = torch.linalg.vector_norm(ref, ord).item()
    return diff / den if den > 0 else diff
