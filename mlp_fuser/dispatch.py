"""Which implementation runs a call: chosen from declared constraints, in this one place.

Every implementation declares the devices, dtypes and shapes it supports. ``select`` keeps the eligible
ones; on CUDA, when several are eligible, each is timed once per shape bucket (M rounded up to a power of
two) and the fastest is cached, so the op is never slower than the best path it knows, the unfused
cuBLAS path included. Candidates are timed by GPU time, each captured in a CUDA graph and replayed.
Under a caller's CUDA-graph capture nothing is timed: run one warm-up call first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from . import config
from .reference import reference_mlp

log = logging.getLogger("mlp_fuser")
ImplFn = Callable[..., Tensor]  # (x2, w_gate, b_gate, w_up, b_up, w_down, b_down, activation) -> y2 (M, O)


@dataclass(frozen=True)
class Problem:
    device: str  # device type: "cuda", "cpu", ...
    dtype: torch.dtype
    M: int
    K: int
    I: int  # noqa: E741 - the MLP's intermediate size, as in the papers
    O: int
    gated: bool


@dataclass(frozen=True)
class Impl:
    name: str
    fn: ImplFn
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})
    max_m: int | None = None  # largest M it supports (or is worth considering for)
    max_o: int | None = None
    triton: bool = False  # a Triton kernel: on CPU only under the interpreter
    notes: str = field(default="", compare=False)

    def why_not(self, p: Problem) -> str | None:
        """None when this implementation supports the problem, else the constraint that fails."""
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
        return None


# ---- the implementations ----------------------------------------------------------------------


def _reference(x2, wg, bg, wu, bu, wd, bd, act):
    return reference_mlp(x2, wg, bg, wu, bu, wd, bd, act)


def _triton_small_m(x2, wg, bg, wu, bu, wd, bd, act):
    from .kernels import fused_mlp_small_m

    return fused_mlp_small_m(x2, wg, bg, wu, bu, wd, bd, act)


def _triton_gemm(x2, wg, bg, wu, bu, wd, bd, act):
    from .kernels import gate_up_act

    return F.linear(gate_up_act(x2, wg, bg, wu, bu, act), wd, bd)


def _triton_gemm_splitk(x2, wg, bg, wu, bu, wd, bd, act):
    from .kernels import gate_up_act
    from .kernels.splitk import linear_splitk

    return linear_splitk(gate_up_act(x2, wg, bg, wu, bu, act), wd, bd)


def _cublas_act_mul(x2, wg, bg, wu, bu, wd, bd, act):
    from .kernels import act_mul

    g = F.linear(x2, wg, bg)
    u = F.linear(x2, wu, bu) if wu is not None else None
    return F.linear(act_mul(g, u, act), wd, bd)


ALL_DEVICES = frozenset({"cuda", "cpu", "mps", "xpu", "meta", "hpu", "privateuseone"})
IMPLS: list[Impl] = [
    Impl("triton_small_m", _triton_small_m, frozenset({"cuda"}), max_m=64, triton=True,
         notes="split over I, intermediate on chip, fp32 atomic reduction of partial outputs (fill, kernel, cast)"),
    Impl("triton_gemm", _triton_gemm, frozenset({"cuda"}), triton=True,
         notes="gate and up in one GEMM with act*mul in its epilogue, then cuBLAS for down"),
    Impl("triton_gemm_splitk", _triton_gemm_splitk, frozenset({"cuda"}), max_m=256, triton=True,
         notes="gate and up in one GEMM with act*mul in its epilogue, then a split-K GEMM streaming w_down once"),
    Impl("cublas_act_mul", _cublas_act_mul, frozenset({"cuda"}), triton=True,
         notes="cuBLAS for the projections, one Triton kernel for act*mul"),
    Impl("reference", _reference, ALL_DEVICES,
         dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
         notes="aten ops, exactly as the unfused module"),
]
IMPLS_BY_NAME = {i.name: i for i in IMPLS}
# Eligibility is cached per power-of-two bucket of M, so every M cap must be a power of two.
assert all(i.max_m is None or i.max_m & (i.max_m - 1) == 0 for i in IMPLS)


def eligible(p: Problem) -> list[Impl]:
    return [i for i in IMPLS if i.why_not(p) is None]


def m_bucket(M: int) -> int:
    return 1 if M <= 1 else 1 << (M - 1).bit_length()


_choice_cache: dict[tuple, str] = {}  # CUDA autotuning: (device, index, dtype, gated, K, I, O, M bucket) -> name
_eligible_cache: dict[tuple, list[Impl]] = {}


def select(p: Problem, args: tuple | None = None) -> Impl:
    """The implementation to run ``p``; ``args`` (the call's arguments) let CUDA autotuning time candidates."""
    ekey = (p.device, p.dtype, p.gated, p.K, p.I, p.O, m_bucket(p.M), config.force_impl, config.triton_on_cpu)
    candidates = _eligible_cache.get(ekey)
    if candidates is not None and len(candidates) == 1:  # the common cases: CPU, or a forced implementation
        return candidates[0]
    if candidates is None:
        candidates = _eligible_cache[ekey] = _candidates(p)
        if len(candidates) == 1:
            return candidates[0]
    if p.device != "cuda" or not config.autotune or args is None:
        return candidates[0]
    key = _choice_key(p)
    name = _choice_cache.get(key)
    if name is None:
        if torch.cuda.is_current_stream_capturing():  # nothing can be timed (or autotuned) now: the aten path
            _warn_capture(p)
            return IMPLS_BY_NAME["reference"]
        name = _time_candidates(candidates, args, p)
        _choice_cache[key] = name
    return IMPLS_BY_NAME[name]


_warned: set = set()


def _warn_capture(p: Problem) -> None:
    if p not in _warned:
        _warned.add(p)
        log.warning("mlp_fuser: first call for %s inside a CUDA-graph capture: running the unfused aten path; "
                    "call the model once before capturing so the fastest implementation can be chosen", describe(p))


def _choice_key(p: Problem) -> tuple:
    return (p.device, torch.cuda.current_device(), p.dtype, p.gated, p.K, p.I, p.O, m_bucket(p.M))


def chosen(p: Problem) -> str:
    """The name of the implementation ``select`` runs for ``p`` (after its first call on CUDA)."""
    cached = _choice_cache.get(_choice_key(p)) if p.device == "cuda" else None
    return cached or select(p).name


def _candidates(p: Problem) -> list[Impl]:
    if config.force_impl:
        impl = IMPLS_BY_NAME.get(config.force_impl)
        if impl is None:
            known = list(IMPLS_BY_NAME)
            raise ValueError(f"mlp_fuser: MLP_FUSER_IMPL={config.force_impl!r} is not one of {known}")
        reason = impl.why_not(p)
        if reason is not None:
            raise ValueError(f"mlp_fuser: forced implementation {impl.name!r} cannot run {p}: {reason}")
        return [impl]
    return eligible(p)


def _time_candidates(candidates: list[Impl], args: tuple, p: Problem) -> str:
    """The fastest candidate by GPU time: each one captured in a CUDA graph (so that Python and launch
    overheads, which graphs remove, do not decide) and replayed. The GPU is kept busy for a moment first and
    the candidates are timed in interleaved rounds: right after an idle stretch (a model's compilation) the
    clocks are still ramping up, and timing one candidate after another would favour the last ones."""
    graphs = {}
    for impl in candidates:
        if impl.name == "reference":
            continue  # the cuBLAS path computes the same thing faster, in fp32 where it matters
        try:
            graphs[impl.name] = _capture(impl.fn, args)
        except Exception as e:  # a kernel that cannot compile for this shape is not chosen; say so
            log.warning("mlp_fuser: %s skipped for %s: %s: %s", impl.name, describe(p), type(e).__name__, e)
    if not graphs:  # every fast path failed here (each said why above): the aten path always runs
        return "reference"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.02:  # 20 ms of back-to-back work: clocks up before timing
        for graph in graphs.values():
            graph.replay()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(7):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    ms = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    best = min(ms, key=ms.get)
    log.info("mlp_fuser: chose %s for %s (%s)", best, describe(p),
              ", ".join(f"{n} {t / _CALLS * 1e3:.1f} µs" for n, t in ms.items()))
    return best


def describe(p: Problem) -> str:
    """One line for logs: the MLP's kind, sizes, dtype and the M bucket a choice is cached for."""
    dtype = str(p.dtype).removeprefix("torch.")
    return (f"{'gated' if p.gated else 'plain'} MLP K={p.K} I={p.I} O={p.O} {dtype}, "
            f"M={p.M} (bucket {m_bucket(p.M)})")


_CALLS = 3  # calls per captured graph


def _capture(fn: ImplFn, args: tuple) -> torch.cuda.CUDAGraph:
    for _ in range(2):
        fn(*args)  # compile, autotune the kernels, size workspaces: never inside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(_CALLS):
            fn(*args)
    return graph
