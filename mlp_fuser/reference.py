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
    return F.linear(reference_gate_up(x, w_gate, b_gate, w_up, b_up, activation), w_down, b_down)


def reference_gate_up(x: Tensor, w_gate: Tensor, b_gate: Tensor | None, w_up: Tensor | None, b_up: Tensor | None,
                      activation: str) -> Tensor:
    """The intermediate h = ``act(gate(x)) * up(x)`` (``act(gate(x))`` when ``w_up`` is None): what the gate/up
    kernels compute."""
    h = get_activation(activation).fn(F.linear(x, w_gate, b_gate))
    return h * F.linear(x, w_up, b_up) if w_up is not None else h


def reference_mlp_backward(dy: Tensor, w_down: Tensor, g: Tensor, u: Tensor | None, activation: str,
                           need_h: bool) -> tuple[Tensor, Tensor | None]:
    """``ops.mlp_backward`` in aten ops: (dgu, h) from dy (M, O), w_down (O, I) and the pre-activations g, u (M, I):
    dgu = [dh·act'(g)·u | dh·act(g)] with dh = dy @ w_down ([dh·act'(g)] without u), h = act(g)·u when ``need_h``.
    Computed in fp32 (fp64 for fp64) and rounded once to dy's dtype, as the Triton kernels do."""
    act, dt = get_activation(activation), torch.promote_types(dy.dtype, torch.float32)
    dh = dy.to(dt).mm(w_down.to(dt))
    g, u = g.to(dt), (u.to(dt) if u is not None else None)
    a = act.fn(g)
    dg = dh * act.grad(g)
    if u is not None:
        dg, a = torch.cat([dg * u, dh * a], 1), a * u
    return dg.to(dy.dtype), (a.to(dy.dtype) if need_h else None)


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
