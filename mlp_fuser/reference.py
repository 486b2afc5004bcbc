"""The aten references, and the error measure every numerical check uses against them.

CPU (and every device without a Triton kernel) runs ``reference_mlp``, so a patched model on the CPU gives the
same numbers as the unpatched one. It is also the correctness oracle's structure (run in float64 by tests).
``reference_experts`` is the routed experts' aten path (``mlp_fuser::moe_mlp``, ``Gate`` the activation between
their projections): the op's CPU path, its autograd path and the dispatcher's ``grouped_mm`` / ``reference`` rows.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compat
from .activations import ACTIVATIONS, get_activation


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


def reference_router_topk(logits: Tensor, k: int, renorm: bool, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The MoE router's top-k (``mlp_fuser::moe_router_topk``) in aten ops, exactly as the routers run them."""
    wts, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    if renorm:
        wts = wts / wts.sum(dim=-1, keepdim=True)
    return wts.to(out_dtype), ids


# ---- the routed experts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gate:
    """What the experts compute between their two projections: ``act(g) * (u + up_offset)`` (clamped with ``limit``,
    before act or after it) for gated experts, ``act(h)`` for plain ones."""

    activation: str
    gated: bool = True
    interleaved: bool = False
    limit: float | None = None
    clamp_after: bool = False
    up_offset: float = 0.0

    def split(self, gu: Tensor) -> tuple[Tensor, Tensor]:
        if self.interleaved:
            return gu[..., 0::2], gu[..., 1::2]
        return gu.chunk(2, dim=-1)

    def __call__(self, gu: Tensor) -> Tensor:
        """A(gu) in gu's dtype, computed as the unfused modules compute it."""
        act = get_activation(self.activation).fn
        if not self.gated:
            return act(gu)
        g, u = self.split(gu)
        L = self.limit
        if L is not None and not self.clamp_after:
            g, u = g.clamp(max=L), u.clamp(min=-L, max=L)
        a = act(g)
        if L is not None and self.clamp_after:
            a, u = a.clamp(max=L), u.clamp(min=-L, max=L)
        return a * (u + self.up_offset) if self.up_offset else a * u

    def describe(self) -> str:
        text = get_activation(self.activation).name + ("" if self.gated else " (plain)")
        if self.limit is not None:
            text += f", clamped at {self.limit:g}" + (" after act" if self.clamp_after else "")
        if self.up_offset:
            text += f", up + {self.up_offset:g}"
        return text + (", interleaved" if self.interleaved else "")


def gates(gated: bool, layouts=(False, True), limits=(None,)):
    """Every activation the op computes for these layouts (interleaved or not) and clamp limits, in a fixed order:
    the candidates an experts module's activation is identified among, by its values."""
    if not gated:
        yield from (Gate(name, False) for name in ACTIVATIONS)
        return
    for name, inter, L, after, off in itertools.product(ACTIVATIONS, layouts, limits, (False, True), (0.0, 1.0)):
        if L is not None or not after:
            yield Gate(name, True, inter, L, after, off)


# ---- the experts' aten path: sorted by expert, one GEMM per expert (torch._grouped_mm where it runs) -------


def _grouped_linear(a: Tensor, w: Tensor, offs: Tensor, experts: Tensor, counts: list[int] | None) -> Tensor:
    """a (S, K), rows sorted by expert (``experts``: each row's, clamped into range; rows past ``offs[-1]`` belong to
    no expert), w (E, N, K) logical: each row times its expert's wᵀ; rows past ``offs[-1]`` are zero or garbage, and
    the caller masks them. ``counts``: the segments' lengths where the host has them (CPU); elsewhere no host sync."""
    if _use_grouped_mm(a, w):
        return compat.grouped_mm(a, w.transpose(1, 2), offs=offs)
    if counts is None:  # no host sync: a gathered weight per row, as transformers' batched_mm does
        return torch.bmm(w[experts], a.unsqueeze(-1)).squeeze(-1)
    out, start = a.new_zeros((a.shape[0], w.shape[1])), 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = F.linear(a[start:start + n], w[e])
        start += n
    return out


def _use_grouped_mm(a: Tensor, w: Tensor) -> bool:
    return (a.is_cuda and a.dtype == torch.bfloat16 and compat.grouped_mm is not None and a.shape[0] > 0
            and a.shape[1] % 8 == 0 and w.shape[1] % 8 == 0 and torch.cuda.get_device_capability(a.device) >= (9, 0))


def reference_experts(x, ids, wts, wgu, bgu, wd, bd, gate: Gate) -> Tensor:
    """The op in aten ops, differentiable and free of host syncs on CUDA: the pairs sorted by expert (sentinels
    last), a GEMM per expert for gate/up and for down (torch._grouped_mm where it runs), A between them, the routing
    weight, then the sum over each token's k pairs in fp32, rounded once."""
    T, k = ids.shape
    E, H = wgu.shape[0], x.shape[-1]
    flat = ids.reshape(-1).long()
    valid = flat < E
    order = torch.argsort(torch.where(valid, flat, E), stable=True)
    per_expert = flat.new_zeros(E + 1).scatter_add_(0, flat.clamp(max=E), torch.ones_like(flat))  # a static shape
    offs = torch.cumsum(per_expert[:E], 0, dtype=torch.int32)
    counts = None if x.is_cuda or compat.is_fake(x) else torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    keep = valid[order].unsqueeze(-1)
    experts = flat[order].clamp(max=E - 1)
    xs = x[order // k].masked_fill(~keep, 0.0)  # its backward zeroes the sentinel rows' gradient
    gu = _grouped_linear(xs, wgu, offs, experts, counts)
    if bgu is not None:
        gu = gu + bgu[experts]
    h = gate(gu.masked_fill(~keep, 0.0))
    o = _grouped_linear(h, wd, offs, experts, counts)
    if bd is not None:
        o = o + bd[experts]
    acc = torch.promote_types(o.dtype, torch.float32)  # fp64 inputs are summed in fp64
    weighted = torch.where(keep, o.to(acc) * wts.reshape(-1)[order].to(acc).unsqueeze(-1), 0.0)
    out = weighted.new_zeros((T * k, H)).index_copy(0, order, weighted)
    return out.view(T, k, H).sum(1).to(x.dtype)
