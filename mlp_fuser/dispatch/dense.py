"""Which implementation runs a call: chosen from declared constraints, in this one place.

Every implementation declares the devices, dtypes and shapes it supports. ``resolve`` keeps the eligible
ones; on CUDA, when several are eligible, each is timed once per shape bucket (M rounded up to a power of
two) and the fastest is cached, so the op is never slower than the best path it knows, the unfused
cuBLAS path included. Candidates are timed by GPU time: the GPU waits on a spin kernel while the calls are
queued, so launch overhead does not decide. Under a caller's CUDA-graph capture nothing is timed: run one
warm-up call first (Inductor's CUDA-graph trees and transformers' static cache always do).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import compat, config
from ..kernels import act_mul, fused_mlp_small_m, gate_up_act, quack_gated
from ..kernels.backward import act_mul_backward, mlp_backward
from ..kernels.common import gate_up_as_one, is_gate_up_as_one, m_bucket
from ..kernels.splitk import linear_splitk, splitk_config, splitk_counters
from ..kernels.swapab import gate_up_act_swapab
from ..reference import reference_mlp, reference_mlp_backward
from ..runtime import plans

log = logging.getLogger("mlp_fuser")
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


@dataclass(frozen=True)
class Impl:
    name: str
    fn: ImplFn
    devices: frozenset[str] | None  # None: every device aten runs on
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})
    max_m: int | None = None  # largest M it supports (or is worth considering for)
    # where it runs correctly but is not worth timing (``not_worth``; a forced implementation runs anyway):
    above_m: int | None = None  # only for more rows than this (a power of two, as max_m)
    gated_only: bool = False  # only for gated MLPs
    max_o: int | None = None
    triton: bool = False  # a Triton kernel: on CPU only under the interpreter
    one_weight: bool = False  # only where gate and up are stored as one weight (Problem.one_weight)
    check: Callable[[Problem], str | None] | None = field(default=None, compare=False)  # any further constraint
    notes: str = field(default="", compare=False)

    def why_not(self, p: Problem) -> str | None:
        """None when this implementation supports the problem, else the constraint that fails."""
        if self.devices is not None:
            devices = set(self.devices)
            if self.triton and config.triton_on_cpu:
                devices.add("cpu")
            if p.device not in devices:
                return f"device {p.device} not in {sorted(devices)}"
        if p.dtype not in self.dtypes:
            return f"dtype {p.dtype} not supported"
        if self.triton and min(p.K, p.I, p.O) < 1:
            return "a zero-sized K, I or O"
        if self.max_m is not None and p.M > self.max_m:
            return f"M={p.M} > {self.max_m}"
        if self.max_o is not None and p.O > self.max_o:
            return f"O={p.O} > {self.max_o}"
        if self.one_weight and not p.one_weight:
            return "gate and up are not stored as one weight without biases (mlp_fuser.merge_gate_up)"
        return self.check(p) if self.check is not None else None

    def not_worth(self, p: Problem) -> str | None:
        """None when the dispatcher should time this implementation for the problem it supports, else why not."""
        if self.above_m is not None and p.M <= self.above_m:
            return f"M={p.M} <= {self.above_m}"
        if self.gated_only and not p.gated:
            return "a plain MLP"
        return None

    def candidate(self, p: Problem) -> bool:
        """Whether the dispatcher times this implementation for ``p``: it runs it and it is worth timing there."""
        return self.why_not(p) is None and self.not_worth(p) is None


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
    Impl("triton_small_m", fused_mlp_small_m, frozenset({"cuda"}), max_m=64, triton=True,
         notes="split over I, intermediate on chip, fp32 atomic reduction of partial outputs (zero, kernel, finish)"),
    Impl("triton_gemm", _triton_gemm, frozenset({"cuda"}), triton=True,
         notes="gate and up in one GEMM with act*mul in its epilogue, then cuBLAS for down"),
    Impl("triton_gemm_splitk", _triton_gemm_splitk, frozenset({"cuda"}), max_m=256, triton=True,
         notes="gate and up in one GEMM with act*mul in its epilogue (zeroing the next kernel's counters), then a "
               "split-K GEMM streaming w_down once: two launches"),
    # max_m 32: past it, slower than triton_gemm or cublas_act_mul yet taken within the tie (NOTES.md, swap-AB gate/up)
    Impl("triton_swapab", _triton_swapab, frozenset({"cuda"}), max_m=32, triton=True,
         notes="gate and up with the weight rows in the dot's M side (wgmma at a few tokens), act*mul in its epilogue "
               "(zeroing the next kernel's counters), then the split-K GEMM streaming w_down: two launches"),
    Impl("cublas_act_mul", _cublas_act_mul, frozenset({"cuda"}), triton=True,
         notes="cuBLAS for the projections (gate and up in one GEMM where they are stored as one weight), one "
               "Triton kernel for act*mul"),
    Impl("cublas_two_streams", _cublas_two_streams, frozenset({"cuda"}), max_m=256, above_m=16, gated_only=True,
         triton=True, notes="cublas_act_mul with gate and up on two streams at once (two branches in a CUDA graph)"),
    # M > 64: at M = 64 it lost to cuBLAS on every measured shape (benchmarks/NOTES.md, quack gated GEMM)
    *(Impl(f"quack_gated_{c}", _quack_gated(c), frozenset({"cuda"}), frozenset({torch.float16, torch.bfloat16}),
           above_m=64, gated_only=True, one_weight=True, check=_quack_check,
           notes=f"quack's warp-specialised gated GEMM ({c} tiles) over gate and up stored as one, act*mul in its "
                 "epilogue, then cuBLAS for down (where quack is installed, sm90)") for c in quack_gated.CONFIGS),
    Impl("reference", reference_mlp, None,
         dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
         notes="aten ops, exactly as the unfused module"),
]
IMPLS_BY_NAME = {i.name: i for i in IMPLS}
# Eligibility is cached per power-of-two bucket of M, so every M cap must be a power of two.
assert all(m is None or m & (m - 1) == 0 for i in IMPLS for m in (i.max_m, i.above_m))


def eligible(p: Problem) -> list[Impl]:
    return [i for i in IMPLS if i.candidate(p)]


# ---- the backward: ops.mlp_backward (dy, w_down, g, u, activation, need_h) -> (dgu, h or None) ----------------


def _cublas_backward(dy, wd, g, u, act, need_h):
    return act_mul_backward(dy, wd, g.contiguous(), u.contiguous() if u is not None else None, act, need_h)


# Chosen like the forward's implementations, by their own list and cache (Problem: K = O, the dh GEMM's reduction).
BACKWARD_IMPLS: list[Impl] = [
    Impl("triton_backward_gemm", mlp_backward, frozenset({"cuda"}), triton=True,
         notes="dh = dy @ w_down in a Triton GEMM with act', the products and h in its epilogue"),
    Impl("cublas_backward_act", _cublas_backward, frozenset({"cuda"}), triton=True,
         notes="dh from cuBLAS, then the same epilogue as one elementwise Triton pass"),
    Impl("reference", reference_mlp_backward, None,
         dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
         notes="aten ops in fp32, rounded once"),
]
BACKWARD_BY_NAME = {i.name: i for i in BACKWARD_IMPLS}


@dataclass(eq=False)
class Registry:
    """One kind of op's implementations, chosen by the code below: one registry per kind (a new op family makes
    its own and passes it to ``resolve``; its Impls' ``why_not``/``candidate`` read its own Problem)."""

    kind: str  # part of every cache key
    impls: list
    baseline: str | None = None  # the unfused path an eager prefill call keeps unless clearly beaten (``_decide``)
    fallback: str = "reference"  # runs anywhere: taken when nothing can be timed, or nothing else runs
    what: str = ""  # how the logs name it: "" for the forward, "the backward of " for the backward

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.impls}
        _REGISTRIES.append(self)


_REGISTRIES: list[Registry] = []
FORWARD = Registry("mlp", IMPLS, baseline="cublas_act_mul")
BACKWARD = Registry("mlp_backward", BACKWARD_IMPLS, what="the backward of ")


# The save-mode forward's act·mul (ops.act_mul): the Triton kernel wherever the Triton implementations run, unless
# the aten reference is forced (MLP_FUSER_IMPL=reference: everything as the unfused module computes it).
_ACT_MUL = Impl("act_mul", act_mul, frozenset({"cuda"}), triton=True)


def triton_act_mul(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ops.act_mul runs the Triton kernel for tensors of this device and dtype."""
    return config.force_impl != "reference" and _ACT_MUL.why_not(Problem(device.type, dtype, 1, 1, 1, 1, True)) is None


# ---- choosing ------------------------------------------------------------------------------------

_resolved: dict[tuple, Impl] = {}  # every call's key -> its final choice: the op's hot path is one lookup here
# CUDA autotuning: (device, index, dtype, gated, K, I, O, M bucket, activation, one_weight) -> (name for graphs, name
# for eager calls)
_choice_cache: dict[tuple, tuple[str, str]] = {}
_eligible_cache: dict[tuple, list[Impl]] = {}
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
    ekey = (reg.kind, p.device, p.dtype, p.gated, p.K, p.I, p.O, m_bucket(p.M), config.force_impl,
            config.triton_on_cpu, config.triton_backward, p.activation, p.one_weight)
    candidates = _eligible_cache.get(ekey)
    if candidates is None:
        candidates = _eligible_cache[ekey] = _candidates(p, reg)
    if len(candidates) == 1 or p.device != "cuda" or not config.autotune or args is None:
        return candidates[0], True
    key = _choice_key(p, index) + (() if reg is FORWARD else (reg.kind,))
    names = _choice_cache.get(key)
    if names is None:
        if torch.cuda.is_current_stream_capturing():  # nothing can be timed (or autotuned) now: the aten path
            _warn_capture(p)
            return reg.by_name[reg.fallback], False
        names = _choice_cache[key] = _time_candidates(candidates, args, p, reg.what, reg.baseline, reg.fallback)
    return reg.by_name[names[eager]], True


def _choice_key(p: Problem, index: int | None) -> tuple:
    return (p.device, index, p.dtype, p.gated, p.K, p.I, p.O, m_bucket(p.M), p.activation, p.one_weight)


def chosen(p: Problem, eager: bool = False) -> str:
    """The name of the implementation the op runs for ``p`` (after its first call, on CUDA: the timed choice;
    ``eager``: for calls through ``patch``)."""
    if p.device == "cuda":
        cached = _choice_cache.get(_choice_key(p, torch.cuda.current_device()))
        if cached:
            return cached[eager]
    return _select(p, None, None)[0].name


def _candidates(p: Problem, reg: Registry = FORWARD) -> list[Impl]:
    """The eligible implementations, or the forced one; forcing another registry's (a backward implementation
    for the forward, a forward one for the backward) leaves this one's choice free ("reference" forces all)."""
    impls = reg.impls
    if config.force_impl:
        impl = reg.by_name.get(config.force_impl)
        if impl is None:
            if any(config.force_impl in r.by_name for r in _REGISTRIES):
                return [i for i in impls if i.candidate(p)]
            known = list(dict.fromkeys(n for r in _REGISTRIES for n in r.by_name))
            raise ValueError(f"mlp_fuser: MLP_FUSER_IMPL={config.force_impl!r} is not one of {known}")
        reason = impl.why_not(p)
        if reason is not None:
            raise ValueError(f"mlp_fuser: forced implementation {impl.name!r} cannot run {p}: {reason}")
        return [impl]
    if reg is BACKWARD and not config.triton_backward:  # the Triton dh GEMM is opt-in (see config)
        return [i for i in impls if i.name != "triton_backward_gemm" and i.why_not(p) is None]
    return [i for i in impls if i.candidate(p)]


_warned: set = set()


def _warn_capture(p: Problem) -> None:
    if p not in _warned:
        _warned.add(p)
        log.warning("mlp_fuser: first call for %s inside a CUDA-graph capture: running the unfused aten path; "
                    "call the model once before capturing so the fastest implementation can be chosen", describe(p))


def describe(p: Problem) -> str:
    """One line for logs: the MLP's kind, sizes, dtype and the M bucket a choice is cached for."""
    dtype = str(p.dtype).removeprefix("torch.")
    return (f"{'gated' if p.gated else 'plain'} MLP K={p.K} I={p.I} O={p.O} {dtype}"
            f"{', ' + p.activation if p.activation else ''}{', gate and up stored as one' if p.one_weight else ''}, "
            f"M={p.M} (bucket {m_bucket(p.M)})")


# ---- timing -------------------------------------------------------------------------------------

_CALLS = 3  # calls per timed sample
_TIE = 0.02  # GPU times this close count as a tie, broken by GPU plus host time
_GPU_BOUND_M = 512  # rows from which a layer's other work (attention, its projections) keeps the GPU busy too
_LARGE_M_MARGIN = 0.05  # from _GPU_BOUND_M rows, how much faster than the baseline an eager call's pick must time
_BASELINE = "cublas_act_mul"  # the unfused module's cuBLAS GEMMs with one act·mul kernel: never slower in situ
_SLEEP_CYCLES = 2_000_000  # about 1 ms at sm90 clocks: longer than the CPU needs to queue _CALLS calls


def _warm_up(fn: ImplFn, args: tuple) -> None:
    """Compile, autotune and run ``fn`` on the call's arguments: what a timed sample must not include."""
    for _ in range(2):
        fn(*args)


def _time_candidates(candidates: list[Impl], args: tuple, p: Problem, what: str = "", baseline: str | None = _BASELINE,
                     fallback: str = "reference") -> tuple[str, str]:
    """(the choice for CUDA graphs, the choice for eager calls), from each candidate's GPU and host time per call
    (``_measure``) as ``_decide`` weighs them; ``fallback`` where none runs."""
    gpu, cpu = _measure(candidates, args, p, fallback)
    if not gpu:  # every fast path failed here (each said why): the aten path always runs
        return fallback, fallback
    best, best_eager = _decide(gpu, cpu, p, baseline)
    log.info("mlp_fuser: chose %s (eager calls: %s) for %s%s (GPU / host µs per call: %s)", best, best_eager, what,
             describe(p), ", ".join(f"{n} {gpu[n] / _CALLS * 1e3:.1f} / {cpu[n] / _CALLS * 1e3:.1f}" for n in gpu))
    return best, best_eager


def _measure(candidates: list[Impl], args: tuple, p, fallback: str = "reference") -> tuple[dict, dict]:
    """GPU and host ms of ``_CALLS`` calls of each candidate that runs (none: empty dicts). Each sample queues the
    calls behind a spin kernel, so the GPU runs them back to back whatever the host costs (a CUDA-graph capture here
    would allocate from whatever memory pool the caller has set up), and the host's time to queue them is measured
    too. The GPU is kept busy for a moment first and the candidates are timed in interleaved rounds: right after an
    idle stretch the clocks are still ramping up, and timing one candidate after another would favour the last."""
    runnable: dict[str, ImplFn] = {}
    for impl in candidates:
        if impl.name == fallback:
            continue  # the cuBLAS path computes the same thing faster, in fp32 where it matters
        try:
            _warm_up(impl.fn, args)
        except Exception as e:  # a kernel that cannot compile for this shape is not chosen; say so
            log.warning("mlp_fuser: %s skipped for %s: %s: %s", impl.name, describe(p), type(e).__name__, e)
            continue
        runnable[impl.name] = _planned(impl, args) or impl.fn
    if not runnable:
        return {}, {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.02:  # 20 ms of back-to-back work: clocks up before timing
        for fn in runnable.values():
            fn(*args)
        torch.cuda.synchronize()
    events: dict[str, list] = {name: [] for name in runnable}
    host: dict[str, list] = {name: [] for name in runnable}
    for _ in range(7):
        for name, fn in runnable.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            compat.gpu_sleep(_SLEEP_CYCLES)
            start.record()
            t0 = time.perf_counter()
            for _ in range(_CALLS):
                fn(*args)
            host[name].append((time.perf_counter() - t0) * 1e3)
            end.record()
            events[name].append((start, end))
        torch.cuda.synchronize()
    gpu = {name: _median([s.elapsed_time(e) for s, e in pairs]) for name, pairs in events.items()}
    cpu = {name: _median(times) for name, times in host.items()}
    return gpu, cpu


def _decide(gpu: dict[str, float], cpu: dict[str, float], p, baseline: str | None = _BASELINE) -> tuple[str, str]:
    """(the choice for CUDA graphs, the choice for eager calls) from GPU and host times. For graphs: the fastest by GPU
    time; among those within ``_TIE`` of it (the timing's noise), the least GPU plus host time, so a lighter host wins
    where it saves more than its GPU time loses. For eager calls: the least GPU plus host time, as a model run without
    graphs waits on the host at small M (decode). From ``_GPU_BOUND_M`` rows (a prefill), where the fastest GPU time
    also exceeds every candidate's host time, the host's time hides behind the GPU's whatever is chosen, so the
    choice for graphs stands for eager calls too; and there an eager call takes the baseline (``cublas_act_mul``,
    the unfused module's GEMMs) unless the other beats it by more than ``_LARGE_M_MARGIN``: a few percent in isolation
    did not survive in situ (benchmarks/NOTES.md, eager choice at prefill)."""
    def total(n):
        return gpu[n] + cpu[n]

    best_gpu = min(gpu.values())
    best = min((n for n in gpu if gpu[n] <= best_gpu * (1 + _TIE)), key=total)
    large = p.M >= _GPU_BOUND_M
    eager = best if large and best_gpu > max(cpu.values()) else min(gpu, key=total)
    if large and baseline in gpu and gpu[baseline] <= gpu[eager] * (1 + _LARGE_M_MARGIN):
        eager = baseline
    return best, eager


def _planned(impl: Impl, args: tuple) -> ImplFn | None:
    """``impl`` as its later calls will run, through a launch plan (``plans``), where it has one: the host time
    the eager choice weighs is then the plan's."""
    if impl.name not in plans.PLANNED or not config.plans:
        return None
    plan = plans.record(impl.name, impl.fn, args[0], args)[1]
    return None if plan is None else lambda *a: plan(*a[:7])


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]
