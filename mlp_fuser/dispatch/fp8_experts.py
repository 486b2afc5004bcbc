"""The FP8 routed experts' paths (``quant_moe_mlp``: ``ops/quant_moe.py``) and those of its backward
(``quant_moe_mlp_backward``: dx and d topk_weights, ``BACKWARD_IMPLS``) as rows of the one dispatcher's tables
(``core``). Not timed: from the top down, the first row that runs a call runs it (or the one ``config.force_impl``
names). A row's ``fn(x2, ids2, wts2, fgu, fd, gate)`` takes the call flattened to (T, H) and (T, k), the checked
weights (``kernels.fp8.Fp8Experts``) and the ``Gate``; the kernels' rows run through a launch plan
(``kernels.moe.experts_plan``) built on a signature's first call and kept with the choice (``run``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import compat, config
from ..activations import get_activation
from ..kernels import fp8 as fp8_kernels
from ..kernels import moe as kmoe
from ..kernels import moe_backward as kbwd
from ..reference import Gate, reference_experts
from . import core
from .core import Impl
from .experts import expert_act
from .fp8 import why_not_kernels


class Problem(NamedTuple):
    device: str  # x's device type
    index: int | None  # x's CUDA device (its capability decides)
    pairs: int  # token-expert pairs, T * k
    k_blocks: tuple  # each weight's (gate/up's, down's) scale block along K; None where not scaled along K

    @property
    def rows(self) -> int:
        return self.pairs


def problem(x2: Tensor, ids2: Tensor, fgu, fd) -> Problem:
    T, k = ids2.shape
    return Problem(x2.device.type, x2.device.index, T * k,
                   tuple(fe.block_k if fe.k_scaled else None for fe in (fgu, fd)))


def _kernels_run(p: Problem) -> str | None:
    return None if p.device == "cpu" and config.triton_on_cpu else why_not_kernels(p.device, p.index)


def _scale_blocks(p: Problem) -> str | None:
    for name, block_k in zip(("w_gate_up", "w_down"), p.k_blocks):
        if block_k is not None and block_k % 16:
            return f"{name}'s scale blocks are {block_k} wide along K: the kernels step K in multiples of 16"
    return None


def _a8_on(p: Problem) -> str | None:
    return None if config.fp8_w8a8 else "mlp_fuser.config.fp8_w8a8 is off: the activations keep their dtype"


def _kernels(path: str, a8: bool) -> tuple:
    """(fn, plan) of the experts kernels (``kernels/moe.py``) through ``path``, x and h quantized per row and 128
    columns (``a8``) or read as they are."""
    def plan(args: tuple):
        x2, ids2, wts2, fgu, fd, gate = args
        return kmoe.experts_plan(x2, ids2, wts2, fgu.w, None, fd.w, None, expert_act(gate), gate.interleaved, path,
                                 scales=(fgu, fd), a8=a8)

    def fn(x2, ids2, wts2, fgu, fd, gate: Gate) -> Tensor:
        return plan((x2, ids2, wts2, fgu, fd, gate))(x2, ids2, wts2, fgu.w, None, fd.w, None, (fgu, fd))
    return fn, plan


def dequantized(x2: Tensor, ids2: Tensor, wts2: Tensor, fgu, fd, gate: Gate) -> Tensor:
    """Each expert's weights dequantized to x's dtype, then the aten experts (differentiable in x and the routing
    weights): what transformers computes on FP8 experts dequantized at load."""
    wgu = fp8_kernels.dequantize_experts(fgu, x2.dtype)
    wd = fp8_kernels.dequantize_experts(fd, x2.dtype)
    return reference_experts(x2, ids2, wts2, wgu, None, wd, None, gate)


def _row(name: str, path: str, a8: bool, *why) -> Impl:
    fn, plan = _kernels(path, a8)
    return Impl(name, fn, None, None, why=(_kernels_run, _scale_blocks, *why), plan=plan)


IMPLS: list[Impl] = [  # from the top down, the first that can run a call runs it
    # the sorted grouped GEMMs on the fp8 tensor cores, x and h quantized (transformers' dynamic scheme); from one
    # token up: faster than a GEMV per pair on FP8 weights (benchmarks/NOTES.md, "FP8 routed experts")
    _row("fp8_moe_sorted_w8a8", "sorted", True, _a8_on),
    _row("fp8_moe_sorted_w8a16", "sorted", False),  # the sorted GEMMs, the weights cast on chip
    Impl("aten_dequantize", dequantized, None, None),  # each expert's weights dequantized to x's dtype, then aten
]
FP8_EXPERTS = core.Registry("fp8_experts", IMPLS, None)


def choose(p: Problem) -> Impl:
    return core.first(FP8_EXPERTS, p)


_PLANS: dict[tuple, tuple] = {}  # (the op's signature of a call, the settings) -> (the row chosen, its plan or None)
_MAX_PLANS = 4096  # a process that sees endless new shapes starts afresh rather than growing the dict


def run(x2: Tensor, ids2: Tensor, wts2: Tensor, fgu, fd, gate: Gate, signature: tuple | None = None) -> Tensor:
    """One checked call (T > 0): the row chosen for its signature (the op's key of everything the call's checks and
    plans read, ``ops/quant_moe.py``), through the plan kept with that choice; None: chosen and planned for this
    call alone."""
    args = (x2, ids2, wts2, fgu, fd, gate)
    if signature is None:
        impl = choose(problem(x2, ids2, fgu, fd))
        plan = impl.plan(args) if impl.plan is not None else None
    else:
        impl, plan = core.kept_plan(_PLANS, (signature, config.fp8_w8a8, config.triton_on_cpu, config.force_impl),
                                    lambda: choose(problem(x2, ids2, fgu, fd)), args, _MAX_PLANS)
    if plan is None:
        return impl.fn(x2, ids2, wts2, fgu, fd, gate)
    return plan(x2, ids2, wts2, fgu.w, None, fd.w, None, (fgu, fd))


def describe(p: Problem) -> str:
    """Which row runs ``p``, and why each one above it does not."""
    return core.describe_first(FP8_EXPERTS, p)


# ---- calls with gradients: dx and d topk_weights (the float8 weights are frozen) ----------------------------------


class BackwardProblem(NamedTuple):
    device: str
    index: int | None
    pairs: int
    k_blocks: tuple  # as Problem's
    activation: str


def backward_problem(x2: Tensor, ids2: Tensor, fgu, fd, gate: Gate) -> BackwardProblem:
    return BackwardProblem(*problem(x2, ids2, fgu, fd), gate.activation)


def _triton_grad(p: BackwardProblem) -> str | None:
    if get_activation(p.activation).triton_grad is None:
        return f"activation {p.activation!r} has no Triton derivative"
    return None


def triton_backward(x2: Tensor, ids2: Tensor, wts2: Tensor, fgu, fd, gate: Gate, dy2: Tensor,
                    need_dx: bool) -> tuple:
    """(dx or None, dwts) by the experts' Triton backward on the float8 weights as stored
    (``kernels.moe_backward``: each weight tile dequantized in registers)."""
    dx, dwts, *_ = kbwd.moe_backward(x2, ids2, wts2, fgu.w, None, fd.w, None, expert_act(gate), gate.interleaved, dy2,
                                     need_dx=need_dx, need_weights=False, scales=(fgu, fd))
    return dx, dwts


def dequantized_backward(x2: Tensor, ids2: Tensor, wts2: Tensor, fgu, fd, gate: Gate, dy2: Tensor,
                         need_dx: bool) -> tuple:
    """(dx or None, dwts) by autograd through ``dequantized`` recomputed from the inputs (a copy of every expert's
    weights in x's dtype)."""
    xx, ww = x2.detach().requires_grad_(need_dx), wts2.detach().requires_grad_()
    with compat.autograd_recording(), torch.enable_grad():
        y = dequantized(xx, ids2, ww, fgu, fd, gate)
        got = torch.autograd.grad(y, [xx, ww] if need_dx else [ww], dy2)
    return (got[0], got[1]) if need_dx else (None, got[0])


BACKWARD_IMPLS: list[Impl] = [  # a row's fn(x2, ids2, wts2, fgu, fd, gate, dy2, need_dx) -> (dx or None, dwts)
    Impl("fp8_moe_triton_backward", triton_backward, None, None, why=(_kernels_run, _scale_blocks, _triton_grad)),
    Impl("aten_dequantize", dequantized_backward, None, None),  # forcing "aten_dequantize" forces both directions
]
FP8_EXPERTS_BACKWARD = core.Registry("fp8_experts_backward", BACKWARD_IMPLS, None, what="the backward of ")


def choose_backward(p: BackwardProblem) -> Impl:
    return core.first(FP8_EXPERTS_BACKWARD, p)


def describe_backward(p: BackwardProblem) -> str:
    """Which backward row runs ``p``, and why each one above it does not."""
    return core.describe_first(FP8_EXPERTS_BACKWARD, p)
