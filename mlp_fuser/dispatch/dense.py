"""The dense MLP op's implementations (``mlp_fuser::mlp``, and its backward) as rows of the one dispatcher's table
(``core``; what each row runs is in runtime/dense.py), and the op's one entry into it, ``run``: called once per call
after the op has validated it, it runs the launch plan kept for the call's signature (``PLANS``, beside the choices),
else the chosen implementation, recording its plan.

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
from torch import Tensor

from .. import compat, config
from ..kernels import act_mul, fused_mlp_small_m, quack_gated
from ..kernels.backward import mlp_backward
from ..kernels.common import is_gate_up_as_one, m_bucket, stored_as_one
from ..reference import reference_mlp, reference_mlp_backward
from ..runtime import dense as runtime
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
           "chosen", "describe", "eligible", "m_bucket", "resolve", "resolve_backward", "run"]


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


def _quack_check(p: Problem) -> str | None:
    return quack_gated.why_not(p.activation, p.K, p.I)


IMPLS: list[Impl] = [
    _row("triton_small_m", fused_mlp_small_m, frozenset({"cuda"}), max_m=64, triton=True,
         notes="split over I, intermediate on chip, fp32 atomic reduction of partial outputs (zero, kernel, finish)"),
    _row("triton_gemm", runtime.triton_gemm, frozenset({"cuda"}), triton=True,
         notes="gate and up in one GEMM with act*mul in its epilogue, then cuBLAS for down"),
    _row("triton_gemm_splitk", runtime.triton_gemm_splitk, frozenset({"cuda"}), max_m=256, triton=True,
         notes="gate and up in one GEMM with act*mul in its epilogue (zeroing the next kernel's counters), then a "
               "split-K GEMM streaming w_down once: two launches"),
    # max_m 32: past it, slower than triton_gemm or cublas_act_mul yet taken within the tie (NOTES.md, swap-AB gate/up)
    _row("triton_swapab", runtime.triton_swapab, frozenset({"cuda"}), max_m=32, triton=True,
         notes="gate and up with the weight rows in the dot's M side (wgmma at a few tokens), act*mul in its epilogue "
               "(zeroing the next kernel's counters), then the split-K GEMM streaming w_down: two launches"),
    _row("cublas_act_mul", runtime.cublas_act_mul, frozenset({"cuda"}), triton=True,
         notes="cuBLAS for the projections (gate and up in one GEMM where they are stored as one weight), one "
               "Triton kernel for act*mul"),
    _row("cublas_two_streams", runtime.cublas_two_streams, frozenset({"cuda"}), max_m=256, above_m=16, gated_only=True,
         triton=True, notes="cublas_act_mul with gate and up on two streams at once (two branches in a CUDA graph)"),
    # M > 64: at M = 64 it lost to cuBLAS on every measured shape (benchmarks/NOTES.md, quack gated GEMM)
    *(_row(f"quack_gated_{c}", runtime.quack_gated_mlp(c), frozenset({"cuda"}),
           frozenset({torch.float16, torch.bfloat16}), above_m=64, gated_only=True, one_weight=True, check=_quack_check,
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


def _opt_in(p: Problem) -> str | None:
    return None if config.triton_backward else "off unless config.triton_backward (forcing runs it)"


# Chosen like the forward's implementations, by their own table (Problem: K = O, the dh GEMM's reduction).
BACKWARD_IMPLS: list[Impl] = [
    _row("triton_backward_gemm", mlp_backward, frozenset({"cuda"}), triton=True, worth=(_opt_in,),
         notes="dh = dy @ w_down in a Triton GEMM with act', the products and h in its epilogue"),
    _row("cublas_backward_act", runtime.cublas_backward, frozenset({"cuda"}), triton=True,
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
           config.triton_backward, eager, activation, one_weight)  # run builds the same key
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
    """The implementation of ops.mlp_backward for one call (``args``: its arguments): the choice's graph row inside
    a CUDA-graph capture, else its plain-call row (``core.pick``'s rule)."""
    return resolve(device, dtype, M, O, I, O, gated, args, not core.capturing(device.type), BACKWARD)


# ---- the op's one entry: after validation, a signature's plan, else the choice (recording its plan) ---------------

PLANS: dict[tuple, ImplFn] = {}  # signature -> the forward's launch plan (run instead of choosing)
SAVING_PLANS: dict[tuple, Callable[..., tuple]] = {}  # signature -> the save-mode forward's plan: (y, g, u)
BACKWARD_PLANS: dict[tuple, Callable[..., tuple]] = {}  # backward signature -> plan: the seven gradients
_MAX_PLANS = 4096  # a process that sees endless new shapes starts afresh rather than growing the dict
generation = 0  # counts the plans' clearings: a plan kept elsewhere (patch's EagerSite) is current while this holds


def plans_apply(x: Tensor) -> bool:
    """Whether calls with input x run launch plans: CUDA, plans on, the private path."""
    return x.is_cuda and config.plans and compat.PRIVATE


def signature(a: tuple, eager: bool) -> tuple:
    """The plan's key for the call ``a`` (its ``MLPArgs``, x as given): see runtime/plans.py's docstring."""
    x, wg, bg, wu, bu, wd, bd, activation = a
    pg = wg.data_ptr()
    if wu is not None:
        pu = wu.data_ptr()
        up = (wu.shape, wu.stride(), wu.dtype, wu.device, pu & 15, stored_as_one(wg, wu, pg, pu))
    return (
        activation, eager, config.force_impl, config.autotune,
        x.dtype is torch.float32 and torch.backends.cuda.matmul.allow_tf32,
        x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15,
        wg.shape, wg.stride(), wg.dtype, wg.device, pg & 15,
        wd.shape, wd.stride(), wd.dtype, wd.device, wd.data_ptr() & 15,
        None if wu is None else up,
        None if bg is None else (bg.shape, bg.stride(), bg.dtype, bg.device, bg.data_ptr() & 15),
        None if bu is None else (bu.shape, bu.stride(), bu.dtype, bu.device, bu.data_ptr() & 15),
        None if bd is None else (bd.shape, bd.stride(), bd.dtype, bd.device, bd.data_ptr() & 15),
    )


def get_plan(key: tuple) -> ImplFn | None:
    """The forward's plan for a signature, or None (none yet, or a launch hook is set: calls take the full path)."""
    plan = PLANS.get(key)
    return plan if plan is None or not compat.launch_hooks() else None


def keep_plan(cache: dict, key: tuple, plan: Callable | None) -> None:
    """``cache[key] = plan`` where there is a plan, the dict started afresh when full."""
    global generation
    if plan is not None:
        if len(cache) >= _MAX_PLANS:
            cache.clear()
            generation += 1
        cache[key] = plan


def clear_plans() -> None:
    """Forget every plan (after the choices are reset)."""
    global generation
    PLANS.clear()
    SAVING_PLANS.clear()
    BACKWARD_PLANS.clear()
    generation += 1


def run(a: MLPArgs, M: int, eager: bool = False, key: tuple | None = None) -> Tensor:
    """One validated forward call of the op (``a``: its operands, x as given with M rows): on CUDA, a signature
    seen before runs its launch plan; otherwise the chosen implementation runs, and where it has a plan its launches
    are recorded into one, kept for the signature (``key``, computed here unless the caller has it). ``eager``: the
    caller runs without CUDA graphs (the choice for such calls)."""
    x = a.x
    if M == 0:
        return x.new_empty((*x.shape[:-1], a.wd.shape[0]))
    planned = plans_apply(x)
    if planned:
        if key is None:
            key = signature(a, eager)
        plan = PLANS.get(key)
        if plan is not None and not compat.launch_hooks():  # get_plan, without its frame
            return plan(*a[:7])
    shape = x.shape
    args = a if len(shape) == 2 else new_args((x.reshape(M, shape[-1]), *a[1:]))
    _, wg, bg, wu, bu, wd, _, activation = args
    one = is_gate_up_as_one(wg, bg, wu, bu)
    device, dtype, K, I, O, gated = x.device, x.dtype, shape[-1], wg.shape[0], wd.shape[0], wu is not None
    impl = _resolved.get((FORWARD, device, dtype, M, K, I, O, gated, config.force_impl, config.triton_on_cpu,
                          config.autotune, config.triton_backward, eager, activation, one))  # resolve's key
    if impl is None:  # a new shape: resolve chooses (and keeps the choice under that key)
        impl = resolve(device, dtype, M, K, I, O, gated, args, eager, FORWARD, activation, one)
    if planned and impl.name in plans.PLANNED:
        y, plan = plans.record(impl.name, impl.fn, x, args)
        keep_plan(PLANS, key, plan)
    else:
        y = impl.fn(*args)
    return y if len(shape) == 2 else y.view(*shape[:-1], O)


def _select(p: Problem, args: tuple | None, index: int | None, eager: bool = False,
            reg: Registry = FORWARD) -> tuple[Impl, bool]:
    """The implementation to run ``p`` and whether that choice is final (to be cached for the shape)."""
    choice = core.choose(reg, p, args, _choice_key(p, index))
    if choice is None:  # the first call of the shape is being captured: the aten path, chosen again later
        return core.capture_row(reg, p), False
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
