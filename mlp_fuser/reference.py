"""The aten reference: the MLP computed exactly as the unfused modules compute it.

CPU (and every device without a Triton kernel) runs this, so a patched model on the CPU gives the same
numbers as the unpatched one. It is also the correctness oracle's structure (run in float64 by tests).
"""

from __future__ import annotations

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
