"""The routed experts' implementations (``mlp_fuser::moe_mlp``) as rows of the one dispatcher's table (``core``).

The Triton paths (``kernels/moe.py``) on CUDA, timed once per bucket of T on the call's own routing, with the host's
time (``wall``: between syncs) for plain calls and on the GPU alone for CUDA-graph captures; ``grouped_mm`` and the
aten path (``reference_experts``) elsewhere or where nothing else runs. The op's backward (``moe_mlp_backward``)
chooses from a table of its own (``BACKWARD``): the Triton backward (``kernels/moe_backward.py``), that backward with
its weight gradients (and dx) by torch's grouped GEMM (``kernels/moe_grouped_wgrad.py``), or autograd through the
aten path recomputed from the inputs, each row timed as the backward alone (the forward is the same for all); calls
whose forward kept gate/up's output (``moe_mlp_save``) are problems of their own, the Triton rows reading it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import compat, config
from ..activations import get_activation
from ..kernels import moe as kmoe
from ..kernels import moe_backward as kbwd
from ..kernels import moe_grouped_wgrad as kgw
from ..kernels.common import next_power_of_2
from ..reference import Gate, reference_experts
from . import core
from .core import Impl

FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
ImplFn = Callable[..., Tensor]  # (x2, ids2, wts2, wgu, bgu, wd, bd, gate) -> y2 (T, H)


@dataclass(frozen=True)
class Problem:
    device: str
    dtype: torch.dtype
    T: int
    k: int
    E: int
    H: int
    I: int
    gate: Gate
    biases: bool

    @property
    def bucket(self) -> int:
        return next_power_of_2(self.T)

    @property
    def rows(self) -> int:  # what the timing's rules read
        return self.T


def runner(impl: Impl, args: tuple) -> Callable[..., Tensor]:
    """``impl.fn`` for calls with ``args``' signature, as a function of (x2, ids2, wts2, wgu, bgu, wd, bd): its
    launch plan where it has one."""
    if impl.plan is not None:
        return impl.plan(args)
    fn, gate = impl.fn, args[-1]
    return lambda x, ids, wts, wgu, bgu, wd, bd: fn(x, ids, wts, wgu, bgu, wd, bd, gate)


def _triton(path: str) -> ImplFn:
    """The Triton kernels (``kernels/moe.py``) through one of their paths."""
    def impl(x, ids, wts, wgu, bgu, wd, bd, gate: Gate):
        return kmoe.moe_experts(x, ids, wts, wgu, bgu, wd, bd, expert_act(gate), gate.interleaved, path)
    return impl


def _triton_plan(path: str) -> Callable[[tuple], Callable[..., Tensor]]:
    """``kernels.moe.experts_plan`` for one of the paths: the launches' integer arguments worked out once."""
    def plan(args):
        gate = args[-1]
        return kmoe.experts_plan(*args[:-1], expert_act(gate), gate.interleaved, path)
    return plan


@functools.lru_cache(maxsize=256)
def expert_act(gate: Gate):
    """The kernels' description of a ``Gate``."""
    return kmoe.ExpertAct(gate.activation, 0.0, gate.limit, gate.clamp_after, gate.up_offset)


def _few_pairs(p: Problem) -> str | None:
    if p.T * p.k <= 64:
        return None
    return f"{p.T * p.k} token-expert pairs > 64 (a GEMV per pair would read shared experts again)"


def _one_token(p: Problem) -> str | None:
    if p.T == 1:
        return None
    return f"{p.T} tokens > 1 (every pair its own block would read an expert shared by tokens again)"


def _tma_ok(p: Problem) -> str | None:
    return kmoe.tma_shape_why_not(torch.device(p.device), p.dtype, p.H, p.I, p.gate.interleaved)


TMA_ROWS = 512  # rows per touched expert from which TMA is timed by default: the GPU's time then dwarfs the host's


def _many_rows(p: Problem) -> str | None:
    pairs, touched = p.T * p.k, min(p.E, p.T * p.k)
    if pairs >= TMA_ROWS * touched:
        return None
    if not config.moe_tma:
        return (f"{pairs} pairs over {touched} experts: < {TMA_ROWS} rows each, where TMA's heavier host can bound a "
                "prefill (MLP_FUSER_MOE_TMA=1 times it from 97)")
    if kmoe.rows_bucket(p.T, p.k, p.E) == 128:  # more than 96 rows per touched expert
        return None
    return f"{pairs} pairs over {touched} experts: <= 96 rows each (TMA measured at about 128)"


def _grouped_mm_ok(p: Problem) -> str | None:
    if compat.grouped_mm is None:
        return "torch has no grouped_mm"
    if p.H % 8 or p.I % 8:
        return "H and I must be multiples of 8"
    return None


def _path(name: str, path: str, why=(), worth=()) -> Impl:
    return Impl(name, _triton(path), frozenset({"cuda"}), triton=True, why=why, worth=worth, plan=_triton_plan(path))


IMPLS: list[Impl] = [  # in priority order: without timing (MLP_FUSER_AUTOTUNE=0) the first eligible runs
    _path("triton_moe_sorted", "sorted"),
    _path("triton_moe_sorted_fused", "sorted_fused"),
    _path("triton_moe_pairs", "pairs", worth=(_few_pairs,)),
    _path("triton_moe_unsorted", "unsorted", worth=(_one_token,)),
    _path("triton_moe_unsorted_pdl", "unsorted_pdl", worth=(_one_token,)),  # Hopper: down overlaps
    _path("triton_moe_sorted_tma", "sorted_tma", why=(_tma_ok,), worth=(_many_rows,)),  # weights by TMA
    Impl("grouped_mm", reference_experts, frozenset({"cuda"}), frozenset({torch.bfloat16}), why=(_grouped_mm_ok,)),
    Impl("reference", reference_experts, None, FLOAT),
]
IMPLS_BY_NAME = {i.name: i for i in IMPLS}

# The experts' rules: no tie (the least GPU time for graphs, the table's order between equals), a plain call's cost
# its wall time between syncs; the sleep (a few ms) outlasts the host's queuing of 3 calls.
EXPERTS = core.Registry("moe", IMPLS, core.Rules(sleep_cycles=10_000_000, wall=True),
                        describe=lambda p: f"moe_mlp {p}")


def eligible(p: Problem) -> list[Impl]:
    return core.candidates(EXPERTS, p)


def _choice_key(p: Problem) -> tuple:
    return (p.device, p.dtype, p.bucket, p.k, p.E, p.H, p.I, p.gate, p.biases, config.moe_tma)


def cached(p: Problem) -> core.Choice | None:
    return core.cached(EXPERTS, _choice_key(p))


def choose(p: Problem, args: tuple) -> Impl:
    """The implementation for ``p``: the only eligible one, or on CUDA the fastest of them, timed once per bucket of
    T on the call's own routing, both with the host's time and on the GPU alone; a call being captured in a CUDA graph
    takes the latter (before any warm-up call chose: the aten path, as timing cannot run inside a capture)."""
    return core.pick(EXPERTS, p, args, _choice_key(p))


def chosen(p: Problem) -> str | None:
    """The name of the implementation chosen for ``p`` so far (for plain calls, and for CUDA graphs where that
    differs), or None."""
    ident = (p.device, p.dtype, p.bucket, p.k, p.E, p.H, p.I, p.gate, p.biases)
    return next((c.name for k, c in core.choices(EXPERTS).items() if k[:9] == ident), None)


# ---- calls with gradients: the Triton backward or autograd through the aten path --------------------------------


@dataclass(frozen=True)
class StepProblem(Problem):
    """A call with gradients: its ``Problem``, which gradients are asked for (frozen experts: no weights') and
    whether the forward saved gate/up's output (backward "save")."""

    need_dx: bool
    need_weights: bool
    saved: bool = False


def problem(x2: Tensor, ids2: Tensor, wgu: Tensor, wd: Tensor, bgu, bd, gate: Gate, *need: bool) -> Problem:
    """The call's ``Problem``; with ``need`` (need_dx, need_weights[, saved]) its ``StepProblem``."""
    return (StepProblem if need else Problem)(x2.device.type, x2.dtype, x2.shape[0], ids2.shape[1], wgu.shape[0],
                                              x2.shape[1], wd.shape[2], gate, bgu is not None or bd is not None, *need)


def triton_backward(x, ids, wts, wgu, bgu, wd, bd, gate: Gate, dy, need_dx: bool, need_weights: bool,
                    wgrad: str = "triton", gu: Tensor | None = None, dgrad: str = "triton") -> tuple:
    """(dx, dwts, dwgu, dbgu, dwd, dbd) from dy (T, H) by ``kernels.moe_backward`` (None where not asked), the
    weight gradients and dx by its Triton kernels or by grouped_mm (``wgrad``, ``dgrad``); ``gu``: the forward's
    gate/up output."""
    return kbwd.moe_backward(x, ids, wts, wgu, bgu, wd, bd, expert_act(gate), gate.interleaved, dy, need_dx=need_dx,
                             need_weights=need_weights, wgrad=wgrad, gu=gu, dgrad=dgrad)


# The rows' functions are the backward op's work, (x2, ids2, wts2, wgu, bgu, wd, bd, gate, dy) ->
# (dx, dwts, dwgu, dbgu, dwd, dbd), None where not asked: what is timed, the op's forward being the same for all.
def _triton_step(wgrad: str, dgrad: str = "triton"):
    def make(need_dx: bool, need_weights: bool, gu: Tensor | None = None):
        def step(x, ids, wts, wgu, bgu, wd, bd, gate, dy):
            return triton_backward(x, ids, wts, wgu, bgu, wd, bd, gate, dy, need_dx, need_weights, wgrad, gu, dgrad)
        return step
    return make


def _aten_step(need_dx: bool, need_weights: bool, gu: Tensor | None = None):  # gu unread: autograd recomputes it
    def step(x, ids, wts, wgu, bgu, wd, bd, gate, dy):
        wants = (need_dx, True, need_weights, need_weights, need_weights, need_weights)
        leaves = [t.detach().requires_grad_(w) if t is not None else None
                  for t, w in zip((x, wts, wgu, bgu, wd, bd), wants)]
        asked = [t for t in leaves if t is not None and t.requires_grad]
        with compat.autograd_recording(), torch.enable_grad():  # gate/up recomputed from x, then autograd
            y = reference_experts(leaves[0], ids, *leaves[1:], gate)
            got = iter(torch.autograd.grad(y, asked, dy))
        return tuple(next(got) if t is not None and t.requires_grad else None for t in leaves)
    return step


def _triton_grad(p: Problem) -> str | None:
    if get_activation(p.gate.activation).triton_grad is None:
        return f"activation {p.gate.activation!r} has no Triton derivative"
    return None


def _grouped_wgrad_ok(p: Problem) -> str | None:
    return kgw.why_not(torch.device(p.device), p.dtype, p.E, p.H, p.I)


def _weights_asked(p: StepProblem) -> str | None:
    if p.need_weights:
        return None
    return "frozen experts: no weight gradients, so triton_moe_backward's work"


def _dx_asked(p: StepProblem) -> str | None:
    if p.need_dx:
        return None
    return "no dx asked, so triton_moe_backward_grouped_wgrad's work"


def _step(make) -> ImplFn:
    """A row's function: (x2, ids2, wts2, wgu, bgu, wd, bd, gate, dy, (need_dx, need_weights[, gu])) -> the
    gradients."""
    return lambda *a: make(*a[-1])(*a[:-1])


BACKWARD_IMPLS: list[Impl] = [
    Impl("triton_moe_backward", _step(_triton_step("triton")), frozenset({"cuda"}), triton=True, why=(_triton_grad,),
         notes="gate/up recomputed (or read, backward 'save'), dh and A' in one kernel, dx by the down kernel, dW "
               "per expert tile"),
    Impl("triton_moe_backward_grouped_wgrad", _step(_triton_step("grouped")), frozenset({"cuda"}), triton=True,
         why=(_triton_grad, _grouped_wgrad_ok), worth=(_weights_asked,),
         notes="the Triton act and dx kernels; dW by torch._grouped_mm (CUTLASS) on expert-sorted copies of "
               "x, w·dy, h and [dg du]"),
    Impl("triton_moe_backward_grouped", _step(_triton_step("grouped", "grouped")), frozenset({"cuda"}), triton=True,
         why=(_triton_grad, _grouped_wgrad_ok), worth=(_dx_asked,),
         notes="the Triton act kernel; dW and dx by torch._grouped_mm (CUTLASS) on expert-sorted copies, dx's k rows "
               "per token summed by a small Triton kernel"),
    Impl("grouped_mm", _step(_aten_step), frozenset({"cuda"}), frozenset({torch.bfloat16}), why=(_grouped_mm_ok,),
         notes="the aten path (torch._grouped_mm) recomputed from the inputs, then autograd through it"),
    Impl("reference", _step(_aten_step), None, FLOAT, notes="the aten path recomputed, then autograd through it"),
]
BACKWARD_BY_NAME = {i.name: i for i in BACKWARD_IMPLS}


BACKWARD = core.Registry("moe_backward", BACKWARD_IMPLS, core.Rules(sleep_cycles=10_000_000, wall=True),
                         what="the backward of ", describe=lambda p: f"moe_mlp {p}")


def _backward_key(p: StepProblem) -> tuple:
    return (*_choice_key(p), p.need_dx, p.need_weights, p.saved)


def choose_backward(p: StepProblem, args: tuple, gu: Tensor | None = None) -> Impl:
    """The implementation of ``mlp_fuser::moe_mlp_backward`` (``args``: the forward's, x and ids 2-D; ``gu``: its
    kept gate/up output where ``p.saved``): on CUDA the faster backward of the eligible rows, timed once per bucket
    of T on the call's own routing and a random dy, its graph row inside a CUDA-graph capture (``core.pick``'s
    rule); the aten path while the first call of a bucket is being captured."""
    found = core.cached(BACKWARD, _backward_key(p))
    if found is None:
        gen = torch.Generator(device=args[0].device).manual_seed(0)  # the caller's random stream left alone
        dy = torch.randn((p.T, p.H), generator=gen, device=args[0].device).to(p.dtype)
        found = core.choose(BACKWARD, p, (*args, dy, (p.need_dx, p.need_weights, gu)), _backward_key(p))
    return core.row_now(BACKWARD, p, found)
