"""The dense MLP op's implementations (``mlp_fuser::mlp``, and its backward) as rows of the one dispatcher's table
(``core``), and the op's entry into it.

Every implementation declares the devices, dtypes and shapes it supports. ``resolve`` keeps the eligible ones; on
CUDA, when several are eligible, each is timed once per shape bucket (M rounded up to a power of two) and the fastest
is cached, so the op is never slower than the best path it knows, the unfused cuBLAS path included (``core``: GPU
time behind a spin kernel, host time, the dense ``_RULES``). Under a caller's CUDA-graph capture nothing is timed:
run one warm-up call first (Inductor's CUDA-graph trees and transformers' static cache always do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import config
from ..kernels import act_mul, fused_mlp_small_m, gate_up_act, quack_gated
from ..kernels.backward import act_mul_backward, mlp_backward
from ..kernels.common import gate_up_as_one, is_gate_up_as_one, m_bucket
from ..kernels.splitk import linear_splitk, splitk_config, splitk_counters
from ..kernels.swapab import gate_up_act_swapab
from ..reference import reference_mlp, reference_mlp_backward
from ..runtime import plans
from . import core
from .core import Impl, Registry

ImplFn = Callable[..., Tensor]  # called as fn(*MLPArgs) -> y2 (M, O)


class MLPArgs(NamedTuple):
    """One call's operands, the record the op passes from its entries through validation, plans and the dispatcher
    (x as given) to the implementations (x flattened to 2-D: ``fn(*args)``, what the dispatcher times and plans
    record). w_up None: a plain MLP (w_gate is then w1, w_down w2)."""

    x: Tensor
    wg: Tensor
    bg: Tensor | None
    wu: Tensor | None
    bu: Tensor | None
    wd: Tensor
    bd: Tensor | None
    activation: str


# new_args((x, wg, ...)): an MLPArgs from a tuple, without the NamedTuple's Python __new__ on the hot path
new_args = partial(tuple.__new__, MLPArgs)

__all__ = ["BACKWARD", "BACKWARD_IMPLS", "FORWARD", "IMPLS", "IMPLS_BY_NAME", "Impl", "MLPArgs", "Problem", "Registry",
           "callable_for", "chosen", "describe", "eligible", "m_bucket", "resolve", "resolve_backward"]


class Problem(NamedTuple):
    device: str  # device type: "cuda", "cpu", ...
    dtype: torch.dtype
    M: int
    K: int
    I: int  # the MLP's intermediate size, as in the papers
    O: int
    gated: bool
    activation: str | None = None  # the op's activation argument (None where no constraint reads it)
    one_weight: bool = False  # gate and up stored as one (2I, K) weight, neither with a bias (common.is_gate_up_as_one)

    @property
    def rows(self) -> int:  # what the timing's rules read
        return self.M


def _at_most(m: int, field: str = "M"):
    """Rows (or, ``field`` O, output features) up to ``m``; M caps are powers of two, as choices are kept per bucket."""
    assert field != "M" or m & (m - 1) == 0, m
    return lambda p: None if getattr(p, field) <= m else f"{field}={getattr(p, field)} > {m}"


def _above(m: int):
    assert m & (m - 1) == 0, m
    return lambda p: f"M={p.M} <= {m}" if p.M <= m else None


def _sized(p: Problem) -> str | None:
    return "a zero-sized K, I or O" if min(p.K, p.I, p.O) < 1 else None


def _gated(p: Problem) -> str | None:
    return None if p.gated else "a plain MLP"


def _one_weight(p: Problem) -> str | None:
    return None if p.one_weight else "gate and up are not stored as one weight without biases (mlp_fuser.merge_gate_up)"


def _row(name: str, fn: ImplFn, devices, dtypes=core.FLOAT, *, triton=False, max_m=None, max_o=None, one_weight=False,
         check=None, above_m=None, gated_only=False, worth=(), notes="") -> Impl:
    """A row of the dense table, its constraints named as the dense Problem reads them: ``max_m``/``max_o``,
    ``one_weight`` (gate and up stored as one) and ``check`` where it cannot run; ``above_m``/``gated_only`` where it
    runs but is not worth timing (forcing runs it anyway)."""
    why = ((_sized,) if triton else ()) + ((_at_most(max_m),) if max_m else ()) + (
        (_at_most(max_o, "O"),) if max_o else ()) + ((_one_weight,) if one_weight else ()) + ((check,) if check else ())
    worth = ((_above(above_m),) if above_m else ()) + ((_gated,) if gated_only else ()) + tuple(worth)
    return Impl(name, fn, devices, dtypes, triton, why, worth, notes=notes)


# ---- the implementations ----------------------------------------------------------------------


def _triton_gemm(x2, wg, bg, wu, bu, wd, bd, act):
    return F.linear(gate_up_act(x2, wg, bg, wu, bu, act), wd, bd)


def _then_splitk_down(gate_up) -> ImplFn:
    """The MLP as ``gate_up`` (gate_up_act's contract; it zeroes the split-K kernel's counters on its way), then the
    split-K down GEMM: two launches."""
    def impl(x2, wg, bg, wu, bu, wd, bd, act):
        M, (O, I) = x2.shape[0], wd.shape
        config = splitk_config(M, O, I, x2.element_size(), x2.device)
        counters = splitk_counters(M, O, I, config, x2.device)
        return linear_splitk(gate_up(x2, wg, bg, wu, bu, act, zero=counters), wd, bd, config, counters=counters)
    return impl


_triton_gemm_splitk = _then_splitk_down(gate_up_act)
_triton_swapab = _then_splitk_down(gate_up_act_swapab)


def _one_gemm_act_mul(x2, wgu, wd, bd, act):
    """Gate and up stored as one weight (``wgu``, their (2I, K) view): one GEMM for both, act·mul on its halves."""
    I = wgu.shape[0] // 2
    gu = F.linear(x2, wgu)
    return F.linear(act_mul(gu[:, :I], gu[:, I:], act), wd, bd)


def _cublas_act_mul(x2, wg, bg, wu, bu, wd, bd, act):
    wgu = gate_up_as_one(wg, bg, wu, bu)
    if wgu is not None:
        return _one_gemm_act_mul(x2, wgu, wd, bd, act)
    g = F.linear(x2, wg, bg)
    u = F.linear(x2, wu, bu) if wu is not None else None
    return F.linear(act_mul(g, u, act), wd, bd)


def _quack_gated(config: str) -> ImplFn:
    """quack's gated GEMM (tile config ``config``) for gate and up stored as one, then cuBLAS for down."""
    def impl(x2, wg, bg, wu, bu, wd, bd, act):
        wgu = gate_up_as_one(wg, bg, wu, bu)
        if wgu is None:  # forced onto weights it cannot take (the dispatcher only times it where they are one)
            raise ValueError("mlp_fuser: quack_gated needs gate and up stored as one weight without biases")
        return F.linear(quack_gated.gated_act(x2, wgu, act, config), wd, bd)
    return impl


def _quack_check(p: Problem) -> str | None:
    return quack_gated.why_not(p.activation, p.K, p.I)


_side_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the stream cublas_two_streams runs up on


def _cublas_two_streams(x2, wg, bg, wu, bu, wd, bd, act):
    """``cublas_act_mul`` with the up GEMM on a second stream, beside the gate GEMM: at M = 32-256 each of the two
    leaves SMs idle, and side by side they fill them (faster in CUDA graphs, slower in plain calls by the host's stream
    switches: benchmarks/NOTES.md, two streams). The fork and the join are stream waits, so a CUDA-graph capture records
    two branches; u is allocated on the caller's stream, which waits for the side stream before anything reads u or
    frees x, u or the weights."""
    if not x2.is_cuda or wu is None:  # the interpreter's CPU runs, or (forced) a plain MLP: one stream
        return _cublas_act_mul(x2, wg, bg, wu, bu, wd, bd, act)
    wgu = gate_up_as_one(wg, bg, wu, bu)
    if wgu is not None:  # stored as one: one stream, whose one GEMM fills the GPU as the two side by side would
        return _one_gemm_act_mul(x2, wgu, wd, bd, act)
    here = torch.cuda.current_stream(x2.device)
    side = _side_streams.get(x2.device.index)
    if side is None:
        side = _side_streams[x2.device.index] = torch.cuda.Stream(x2.device)
    u = torch.empty((x2.shape[0], wu.shape[0]), dtype=x2.dtype, device=x2.device)
    side.wait_stream(here)  # x, and u's memory, are ready
    with torch.cuda.stream(side):
        torch.mm(x2, wu.t(), out=u) if bu is None else torch.addmm(bu, x2, wu.t(), out=u)
    g = F.linear(x2, wg, bg)
    here.wait_stream(side)  # u is written
    return F.linear(act_mul(g, u, act), wd, bd)


IMPLS: list[Impl] = [
    _row("triton_small_m", fused_mlp_small_m, frozenset({"cuda"}), max_m=64, triton=True,
         notes="split over I, intermediate on chip, fp32 atomic reduction of partial outputs (zero, kernel, finish)"),
    _row("triton_gemm", _triton_gemm, frozenset({"cuda"}), triton=True,
         notes="gate and up in one GEMM with act*mul in its epilogue, then cuBLAS for down"),
    _row("triton_gemm_splitk", _triton_gemm_splitk, frozenset({"cuda"}), max_m=256, triton=True,
         notes="gate and up in one GEMM with act*mul in its epilogue (zeroing the next kernel's counters), then a "
               "split-K GEMM streaming w_down once: two launches"),
    # max_m 32: past it, slower than triton_gemm or cublas_act_mul yet taken within the tie (NOTES.md, swap-AB gate/up)
    _row("triton_swapab", _triton_swapab, frozenset({"cuda"}), max_m=32, triton=True,
         notes="gate and up with the weight rows in the dot's M side (wgmma at a few tokens), act*mul in its epilogue "
               "(zeroing the next kernel's counters), then the split-K GEMM streaming w_down: two launches"),
    _row("cublas_act_mul", _cublas_act_mul, frozenset({"cuda"}), triton=True,
         notes="cuBLAS for the projections (gate and up in one GEMM where they are stored as one weight), one "
               "Triton kernel for act*mul"),
    _row("cublas_two_streams", _cublas_two_streams, frozenset({"cuda"}), max_m=256, above_m=16, gated_only=True,
         triton=True, notes="cublas_act_mul with gate and up on two streams at once (two branches in a CUDA graph)"),
    # M > 64: at M = 64 it lost to cuBLAS on every measured shape (benchmarks/NOTES.md, quack gated GEMM)
    *(_row(f"quack_gated_{c}", _quack_gated(c), frozenset({"cuda"}), frozenset({torch.float16, torch.bfloat16}),
           above_m=64, gated_only=True, one_weight=True, check=_quack_check,
           notes=f"quack's warp-specialised gated GEMM ({c} tiles) over gate and up stored as one, act*mul in its "
                 "epilogue, then cuBLAS for down (where quack is installed, sm90)") for c in quack_gated.CONFIGS),
    _row("reference", reference_mlp, None,
         dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
         notes="aten ops, exactly as the unfused module"),
]
IMPLS_BY_NAME = {i.name: i for i in IMPLS}


def eligible(p: Problem) -> list[Impl]:
    return [i for i in IMPLS if i.candidate(p)]


# ---- the backward: ops.mlp_backward (dy, w_down, g, u, activation, need_h) -> (dgu, h or None) ----------------


def _cublas_backward(dy, wd, g, u, act, need_h):
    return act_mul_backward(dy, wd, g.contiguous(), u.contiguous() if u is not None else None, act, need_h)


def _opt_in(p: Problem) -> str | None:
    return None if config.triton_backward else "off unless config.triton_backward (forcing runs it)"


# Chosen like the forward's implementations, by their own table (Problem: K = O, the dh GEMM's reduction).
BACKWARD_IMPLS: list[Impl] = [
    _row("triton_backward_gemm", mlp_backward, frozenset({"cuda"}), triton=True, worth=(_opt_in,),
         notes="dh = dy @ w_down in a Triton GEMM with act', the products and h in its epilogue"),
    _row("cublas_backward_act", _cublas_backward, frozenset({"cuda"}), triton=True,
         notes="dh from cuBLAS, then the same epilogue as one elementwise Triton pass"),
    _row("reference", reference_mlp_backward, None,
         dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
         notes="aten ops in fp32, rounded once"),
]
BACKWARD_BY_NAME = {i.name: i for i in BACKWARD_IMPLS}


# The dense rules (benchmarks/NOTES.md: the tie, eager choice at prefill): GPU times within 2% tie, broken by GPU
# plus host time; from 512 rows a layer's other work keeps the GPU busy too, and there an eager call keeps the
# unfused module's cuBLAS GEMMs (never slower in situ) unless another path times 5% faster. The sleep (about 1 ms at
# sm90 clocks) outlasts the host's queuing of 3 calls; 20 ms of work first brings the clocks up.
_RULES = core.Rules(sleep_cycles=2_000_000, ramp_s=0.02, tie=0.02, gpu_bound_m=512, large_m_margin=0.05,
                    baseline="cublas_act_mul")


def describe(p: Problem) -> str:
    """One line for logs: the MLP's kind, sizes, dtype and the M bucket a choice is cached for."""
    dtype = str(p.dtype).removeprefix("torch.")
    return (f"{'gated' if p.gated else 'plain'} MLP K={p.K} I={p.I} O={p.O} {dtype}"
            f"{', ' + p.activation if p.activation else ''}{', gate and up stored as one' if p.one_weight else ''}, "
            f"M={p.M} (bucket {m_bucket(p.M)})")


def _planned(impl: Impl, args: tuple) -> ImplFn:
    """``impl`` as its later calls will run, through a launch plan (``plans``), where it has one: the host time
    the eager choice weighs is then the plan's."""
    if impl.name not in plans.PLANNED or not config.plans:
        return impl.fn
    plan = plans.record(impl.name, impl.fn, args[0], args)[1]
    return impl.fn if plan is None else lambda *a: plan(*a[:7])


FORWARD = Registry("mlp", IMPLS, _RULES, describe=describe, timed=_planned)
BACKWARD = Registry("mlp_backward", BACKWARD_IMPLS, dataclasses.replace(_RULES, baseline=None),
                    what="the backward of ", describe=describe, timed=_planned)


# The save-mode forward's act·mul (ops.act_mul): the Triton kernel wherever the Triton implementations run, unless
# the aten reference is forced (MLP_FUSER_IMPL=reference: everything as the unfused module computes it).
_ACT_MUL = _row("act_mul", act_mul, frozenset({"cuda"}), triton=True)


def triton_act_mul(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ops.act_mul runs the Triton kernel for tensors of this device and dtype."""
    return config.force_impl != "reference" and _ACT_MUL.why_not(Problem(device.type, dtype, 1, 1, 1, 1, True)) is None


# ---- choosing ------------------------------------------------------------------------------------

_resolved: dict[tuple, Impl] = {}  # every call's key -> its final choice: the op's hot path is one lookup here
_MAX_RESOLVED = 8192  # a process that sees endless new shapes starts the lookup afresh rather than growing it


def resolve(device: torch.device, dtype: torch.dtype, M: int, K: int, I: int, O: int, gated: bool,
            args: tuple, eager: bool = False, reg: Registry = FORWARD, activation: str | None = None,
            one_weight: bool = False) -> Impl:
    """The implementation for one call of the op: a dict lookup once the shape's choice is made.

    ``args`` (the call's arguments, x flattened to 2-D) let CUDA autotuning time the candidates. ``eager``: the
    caller runs without CUDA graphs (``patch``, and the backend's graphs where the mode has none), so the choice
    weighs the host's time per call beside the GPU's.
    ``reg``: the registry (``FORWARD`` or ``BACKWARD``).
    ``activation`` and ``one_weight``: as in ``Problem``, for the implementations whose constraints read them."""
    key = (reg, device, dtype, M, K, I, O, gated, config.force_impl, config.triton_on_cpu, config.autotune,
           config.triton_backward, eager, activation, one_weight)  # callable_for builds the same key
    impl = _resolved.get(key)
    if impl is None:
        p = Problem(device.type, dtype, M, K, I, O, gated, activation, one_weight)
        impl, final = _select(p, args, device.index, eager, reg)
        if final:
            if len(_resolved) >= _MAX_RESOLVED:
                _resolved.clear()
            _resolved[key] = impl
    return impl


def resolve_backward(device: torch.device, dtype: torch.dtype, M: int, I: int, O: int, gated: bool,
                     args: tuple) -> Impl:
    """The implementation of ops.mlp_backward for one call (``args``: its arguments)."""
    return resolve(device, dtype, M, O, I, O, gated, args, False, BACKWARD)


def callable_for(x: Tensor, args: MLPArgs, M: int, eager: bool, plan_key: tuple | None) -> ImplFn:
    """What runs one forward call of the op (``fn(*args)``): the chosen implementation, which on this call also
    records its launch plan for ``plan_key`` where it has one (``plans``: later calls with that signature run the
    plan and come nowhere near here). ``x``: the call's input as given (the plan passes its pointer)."""
    _, wg, bg, wu, bu, wd, _, activation = args
    one = is_gate_up_as_one(wg, bg, wu, bu)
    device, dtype, K, I, O, gated = x.device, x.dtype, x.shape[-1], wg.shape[0], wd.shape[0], wu is not None
    impl = _resolved.get((FORWARD, device, dtype, M, K, I, O, gated, config.force_impl, config.triton_on_cpu,
                          config.autotune, config.triton_backward, eager, activation, one))  # resolve's key
    if impl is None:  # a new shape: resolve chooses (and keeps the choice under that key)
        impl = resolve(device, dtype, M, K, I, O, gated, args, eager, FORWARD, activation, one)
    if plan_key is None or impl.name not in plans.PLANNED:
        return impl.fn
    return lambda *a: plans.run_and_plan(plan_key, impl.name, impl.fn, x, new_args(a))  # a record, as plans read it


def _select(p: Problem, args: tuple | None, index: int | None, eager: bool = False,
            reg: Registry = FORWARD) -> tuple[Impl, bool]:
    """The implementation to run ``p`` and whether that choice is final (to be cached for the shape)."""
    choice = core.choose(reg, p, args, _choice_key(p, index))
    if choice is None:  # the first call of the shape is being captured: the aten path, chosen again later
        return reg.by_name[reg.fallback], False
    return choice[eager], True


def _choice_key(p: Problem, index: int | None) -> tuple:
    """What a choice is kept for: the device, the shape with M's bucket, the settings the rows read."""
    return (p.device, index, p.dtype, p.gated, p.K, p.I, p.O, m_bucket(p.M), p.activation, p.one_weight,
            config.triton_backward)


def chosen(p: Problem, eager: bool = False) -> str:
    """The name of the implementation the op runs for ``p`` (after its first call, on CUDA: the timed choice;
    ``eager``: for calls through ``patch``)."""
    if p.device == "cuda":
        cached = core.cached(FORWARD, _choice_key(p, torch.cuda.current_device()))
        if cached:
            return cached[eager].name
    return _select(p, None, None)[0].name
