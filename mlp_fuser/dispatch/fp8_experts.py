"""The FP8 routed experts' paths (``quant_moe_mlp``: ``ops/quant_moe.py``) and those of its backward
(``quant_moe_mlp_backward``: dx and d topk_weights, ``BACKWARD_IMPLS``) as rows of the one dispatcher's tables
(``core``). The forward's rows are timed where more than one is a candidate (one token: the sorted and the unsorted
paths and the one-launch kernel, ``kernels/moe_one.py``), as the bf16 experts' are: once per key, GPU time for calls
being captured in CUDA graphs, wall time for plain calls; elsewhere (one candidate, the CPU, ``config.autotune`` off)
the first candidate runs, or the one ``config.force_impl`` names. A row's ``fn(x2, ids2, wts2, fgu, fd, gate)`` takes
the call flattened to (T, H) and (T, k), the checked weights (``kernels.fp8.Fp8Experts``) and the ``Gate``; the
kernels' rows run through a launch plan (``kernels.moe.experts_plan``, ``kernels.moe_one.one_plan``) built when a
signature's row is chosen and kept with the choice (``run``). The backward is not timed: from the top down, the first
row that runs a call runs it.
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
from ..kernels import moe_one as kone
from ..kernels.common import next_power_of_2
from ..reference import Gate, reference_experts
from . import core
from .core import Impl
from .experts import expert_act
from .fp8 import kernels_run


class Problem(NamedTuple):
    device: str  # x's device type
    index: int | None  # x's CUDA device (its capability decides)
    pairs: int  # token-expert pairs, T * k
    k_blocks: tuple  # each weight's (gate/up's, down's) scale block along K; None where not scaled along K
    tokens: int = 1  # T
    shapes: tuple = ()  # what else a timed choice depends on: x's dtype, k, the gate, each weight's layout

    @property
    def rows(self) -> int:
        return self.pairs


def problem(x2: Tensor, ids2: Tensor, fgu, fd, gate: Gate | None = None) -> Problem:
    T, k = ids2.shape
    layouts = ((tuple(fe.w.shape), tuple(fe.scale.shape), fe.block_n, fe.up_soff) for fe in (fgu, fd))
    k_blocks = tuple(fe.block_k if fe.k_scaled else None for fe in (fgu, fd))
    return Problem(x2.device.type, x2.device.index, T * k, k_blocks, T, (x2.dtype, k, gate, *layouts))


def _scale_blocks(p: Problem) -> str | None:
    for name, block_k in zip(("w_gate_up", "w_down"), p.k_blocks):
        if block_k is not None and block_k % 16:
            return f"{name}'s scale blocks are {block_k} wide along K: the kernels step K in multiples of 16"
    return None


def _a8_on(p: Problem) -> str | None:
    return None if config.fp8_w8a8 else "mlp_fuser.config.fp8_w8a8 is off: the activations keep their dtype"


def _a8_blocks(p: Problem) -> str | None:
    for name, block_k in zip(("w_gate_up", "w_down"), p.k_blocks):
        if (why := fp8_kernels.a8_why_not(block_k)) is not None:
            return f"{name}'s {why}"
    return None


def _a8_off(p: Problem) -> str | None:  # a worth check: the W8A8 rows compute what the config asks (forcing runs it)
    if config.fp8_w8a8 and _a8_blocks(p) is None:
        return "mlp_fuser.config.fp8_w8a8 is on: the W8A8 rows run"
    return None


def _one_token(p: Problem) -> str | None:
    if p.tokens == 1:
        return None
    return f"{p.tokens} tokens > 1 (every pair its own block would read an expert shared by tokens again)"


def _tma_ok(p: Problem) -> str | None:
    """``kmoe.tma_shape_why_not`` for the float8 weights (rows of H and I bytes in 16-byte multiples, gate and up
    rows apart); a call whose weights are not contiguous and 16-byte aligned (``kmoe.tma_why_not``) runs the
    pointer kernels."""
    gate, (w_d, *_) = p.shapes[2], p.shapes[4]  # shapes: (x's dtype, k, gate, gate/up's layout, down's layout)
    _, H, I = w_d
    device = torch.device(p.device) if p.index is None else torch.device(p.device, p.index)
    return kmoe.tma_shape_why_not(device, fp8_kernels.FP8, H, I, gate is not None and gate.interleaved)


TMA_ROWS = 64  # rows per touched expert from which the TMA row is timed: BLOCK_M 64 tiles about full


def _touched(p: Problem) -> int:
    """The experts a call touches, at most: its pairs, or w_down's E."""
    return max(1, min(p.pairs, p.shapes[4][0][0]))


def _many_rows(p: Problem) -> str | None:
    touched = _touched(p)
    if p.pairs >= TMA_ROWS * touched:
        return None
    return f"{p.pairs} pairs over {touched} experts: < {TMA_ROWS} rows each (TMA's W8A8 tiles are 64 rows)"


# the one-launch row is timed up to this many (token, expert) pairs: at Qwen3-30B-A3B's 64 the sorted row was as fast
# (NOTES, "One token in one launch")
ONE_LAUNCH_PAIRS = 32


def _few_pairs(p: Problem) -> str | None:
    """Each pair its own programs in the one-launch kernel: an expert two tokens share is read twice (from L2 at
    best), so it is timed where the pairs are few and mostly of distinct experts."""
    touched = _touched(p)
    if p.pairs <= ONE_LAUNCH_PAIRS and 2 * p.pairs <= 3 * touched:
        return None
    return (f"{p.pairs} pairs over at most {touched} experts (timed up to {ONE_LAUNCH_PAIRS} pairs, 1.5 a touched "
            "expert: each pair reads its expert's weights)")


def _one_launch_on(p: Problem) -> str | None:  # a worth check: forcing runs it
    return None if config.fp8_one_launch else "mlp_fuser.config.fp8_one_launch is off"


def _no_kernels(p: Problem) -> str | None:  # the dequantized copy only where no kernel row runs (forcing runs it)
    return None if kernels_run(p) or _scale_blocks(p) else "the kernels run it"


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


def _one_launch() -> tuple:
    """(fn, plan) of the one-launch kernel (``kernels/moe_one.py``): gate/up, h in registers, down and the combine
    in one kernel (a small launch after it casts y), W8A16 (x as it is, each float8 tile dequantized in registers)."""
    def plan(args: tuple):
        x2, ids2, wts2, fgu, fd, gate = args
        return kone.one_plan(x2, ids2, wts2, fgu, fd, expert_act(gate), gate.interleaved)

    def fn(x2, ids2, wts2, fgu, fd, gate: Gate) -> Tensor:
        return plan((x2, ids2, wts2, fgu, fd, gate))(x2, ids2, wts2, fgu.w, None, fd.w, None, (fgu, fd))
    return fn, plan


def _row(name: str, path: str, a8: bool, why=(), worth=()) -> Impl:
    fn, plan = _kernels(path, a8)
    return Impl(name, fn, None, None, why=(kernels_run, _scale_blocks, *why), worth=worth, plan=plan)


_ONE = _one_launch()
IMPLS: list[Impl] = [  # the candidates of a call timed where more than one (else the first runs); sorted first
    # the sorted grouped GEMMs on the fp8 tensor cores, x and h quantized (transformers' dynamic scheme); from one
    # token up: faster than a GEMV per pair on FP8 weights (benchmarks/NOTES.md, "FP8 routed experts")
    _row("fp8_moe_sorted_w8a8", "sorted", True, (_a8_on, _a8_blocks)),
    _row("fp8_moe_sorted_w8a16", "sorted", False, worth=(_a8_off,)),  # the sorted GEMMs, the weights cast on chip
    # the sorted W8A8 GEMMs with the float8 weight tiles read as TMA boxes (x and h gathered by pointer): timed
    # against the pointer row where each touched expert has a 64-row tile's worth
    _row("fp8_moe_sorted_tma_w8a8", "sorted_tma", True, (_a8_on, _a8_blocks, _tma_ok), (_many_rows,)),
    # one token: every pair its own block, no routing sort, down+combine in one launch (PDL: down overlaps, Hopper)
    _row("fp8_moe_unsorted_w8a8", "unsorted", True, (_a8_on, _a8_blocks), (_one_token,)),
    _row("fp8_moe_unsorted_pdl_w8a8", "unsorted_pdl", True, (_a8_on, _a8_blocks), (_one_token,)),
    _row("fp8_moe_unsorted_w8a16", "unsorted", False, worth=(_one_token, _a8_off)),
    _row("fp8_moe_unsorted_pdl_w8a16", "unsorted_pdl", False, worth=(_one_token, _a8_off)),
    # a few tokens in one kernel: h born in registers, each pair's slice of I adding its part of y by fp32 atomics,
    # a small launch after it casting y (benchmarks/NOTES.md, "One token in one launch"). W8A16 under either setting of
    # config.fp8_w8a8: x unquantized errs less than transformers' W8A8, so the timing alone decides
    # (config.fp8_one_launch off: not timed)
    Impl("fp8_moe_one_launch", _ONE[0], None, None, why=(kernels_run, _scale_blocks),
         worth=(_few_pairs, _one_launch_on), plan=_ONE[1]),
    # each expert's weights dequantized to x's dtype, then aten: where no kernel row runs
    Impl("aten_dequantize", dequantized, None, None, worth=(_no_kernels,)),
]


def _planned(impl: Impl, args: tuple):
    """What a timed sample calls: the row through its launch plan, as ``run`` calls it."""
    if impl.plan is None:
        return impl.fn
    plan = impl.plan(args)
    return lambda x2, ids2, wts2, fgu, fd, gate: plan(x2, ids2, wts2, fgu.w, None, fd.w, None, (fgu, fd))


# The experts' rules (dispatch/experts.py): the least GPU time for graphs, the least wall time for plain calls.
FP8_EXPERTS = core.Registry("fp8_experts", IMPLS, core.Rules(sleep_cycles=10_000_000, wall=True),
                            fallback="aten_dequantize", timed=_planned,
                            first_capture="first",  # not the fallback: that would dequantize every expert's weights
                            describe=lambda p: f"quant_moe_mlp (T={p.tokens}, {p.shapes})")


def _choice_key(p: Problem) -> tuple:
    return (p.device, p.index, next_power_of_2(p.tokens), p.k_blocks, p.shapes, config.fp8_w8a8)


def eligible(p: Problem) -> list[Impl]:
    """The rows timed for ``p`` (one: no timing), or the forced one."""
    return core.candidates(FP8_EXPERTS, p)


def choose(p: Problem, args: tuple | None = None) -> Impl:
    """The row for ``p`` (``core.pick``): the only candidate, or on CUDA the fastest of them, timed once per key on
    ``args`` (the call's own; None: the choice kept so far, else the first candidate, nothing timed). The first call of
    a key being captured in a CUDA graph cannot time: the first candidate runs it, and nothing is kept."""
    return core.pick(FP8_EXPERTS, p, args, _choice_key(p))


def chosen(p: Problem) -> str | None:
    """The name of the row chosen for ``p``'s key so far (for plain calls, and for CUDA graphs where that differs),
    or None."""
    found = core.cached(FP8_EXPERTS, _choice_key(p))
    return found.name if found is not None else None


_PLANS: dict[tuple, tuple] = {}  # (the op's signature, the settings) -> (eager row, its plan, graph row, its plan)
_MAX_PLANS = 4096  # a process that sees endless new shapes starts afresh rather than growing the dict


def _plan(impl: Impl, args: tuple):
    return impl.plan(args) if impl.plan is not None else None


def run(x2: Tensor, ids2: Tensor, wts2: Tensor, fgu, fd, gate: Gate, signature: tuple | None = None) -> Tensor:
    """One checked call (T > 0): the row chosen for its signature (the op's key of everything the call's checks and
    plans read, ``ops/quant_moe.py``), through the plan kept with that choice (the one for CUDA graphs while
    capturing, where it differs); None: chosen and planned for this call alone."""
    args = (x2, ids2, wts2, fgu, fd, gate)
    hit = None
    if signature is not None:
        key = (signature, config.fp8_w8a8, config.triton_on_cpu, config.force_impl, config.autotune,
               config.moe_rows_lowp)
        hit = _PLANS.get(key)
    if hit is None:
        p = problem(x2, ids2, fgu, fd, gate)
        impl = choose(p, args)
        plan = _plan(impl, args)
        kept = core.cached(FP8_EXPERTS, _choice_key(p)) if signature is not None else None
        if kept is not None:  # a choice that stands (timed, or the only one): kept with its plans
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            plans = {impl: plan}
            for other in (kept.eager, kept.graph):
                if other not in plans:
                    plans[other] = _plan(other, args)
            _PLANS[key] = (kept.eager, plans[kept.eager], kept.graph, plans[kept.graph])
    else:
        impl, plan = hit[:2]
        if hit[2] is not impl and x2.is_cuda and torch.cuda.is_current_stream_capturing():
            impl, plan = hit[2:]
    if plan is None:
        return impl.fn(x2, ids2, wts2, fgu, fd, gate)
    return plan(x2, ids2, wts2, fgu.w, None, fd.w, None, (fgu, fd))


def describe(p: Problem) -> str:
    """Each row: why it cannot run ``p``, why it is not timed there, or that it is a candidate (several: timed on
    CUDA, else the first runs)."""
    lines = []
    for impl in IMPLS:
        why = impl.why_not(p)
        worth = impl.not_worth(p) if why is None else None
        lines.append(f"{impl.name}: " + (why or (f"not timed: {worth}" if worth else "candidate")))
    return "\n".join(lines)


# ---- calls with gradients: dx and d topk_weights (the float8 weights are frozen) ----------------------------------


class BackwardProblem(NamedTuple):
    device: str
    index: int | None
    pairs: int
    k_blocks: tuple  # as Problem's
    activation: str


def backward_problem(x2: Tensor, ids2: Tensor, fgu, fd, gate: Gate) -> BackwardProblem:
    p = problem(x2, ids2, fgu, fd)
    return BackwardProblem(p.device, p.index, p.pairs, p.k_blocks, gate.activation)


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
    Impl("fp8_moe_triton_backward", triton_backward, None, None, why=(kernels_run, _scale_blocks, _triton_grad)),
    Impl("aten_dequantize", dequantized_backward, None, None),  # forcing "aten_dequantize" forces both directions
]
FP8_EXPERTS_BACKWARD = core.Registry("fp8_experts_backward", BACKWARD_IMPLS, None, what="the backward of ")


def choose_backward(p: BackwardProblem) -> Impl:
    return core.first(FP8_EXPERTS_BACKWARD, p)


def describe_backward(p: BackwardProblem) -> str:
    """Which backward row runs ``p``, and why each one above it does not."""
    return core.describe_first(FP8_EXPERTS_BACKWARD, p)
