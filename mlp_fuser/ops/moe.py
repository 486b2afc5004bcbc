"""The routed-experts op ``mlp_fuser::moe_mlp``: a mixture of experts' routed MLPs as one call.

    moe_mlp(x, topk_ids, topk_weights, w_gate_up, b_gate_up, w_down, b_down, activation,
            interleaved=False, limit=None, clamp_after=False, up_offset=0.0)
    y[t] = Σ_j topk_weights[t, j] · (A(x[t] @ w_gate_up[e]ᵀ + b_gate_up[e]) @ w_down[e]ᵀ + b_down[e])
    with e = topk_ids[t, j]

x is (T, H) (any leading dimensions); topk_ids (T, k) integer and topk_weights (T, k) floating, as transformers'
routers return them; expert ids >= E (expert-parallel sentinels) contribute nothing. The stacked weights are taken
in their logical shapes with any strides: ``w_gate_up`` (E, 2I, H) for gated experts (gate rows first, or gate and
up rows alternating with ``interleaved``, GPT-OSS's layout) or (E, I, H) for plain ones, ``w_down`` (E, H, I);
GPT-OSS's transposed storage is passed as ``.transpose(1, 2)`` views, never copied. Biases are (E, 2I) / (E, I) and
(E, H). The gated activation A(g, u), in fp32 (``Gate``):
    g, u clamped (``limit``: g <= limit, |u| <= limit) before act, or act(g) and u clamped after it (``clamp_after``);
    A = act(g) · (u + up_offset)   (GPT-OSS: quick_gelu, limit 7, up_offset 1; DeepSeek-V4: silu, limit)
and A = act(gu) for plain experts.

Kernels, top of the dispatcher down: autocast (like nn.Linear: floating inputs cast to the autocast dtype);
autograd (with gradients needed: the grouped aten path below, which autograd differentiates, dx, d weights and
d routing weights); every device: ``_forward`` runs what ``choose`` picked from ``IMPLS`` (the Triton paths on CUDA,
timed once per shape bucket, for plain calls and for CUDA-graph captures apart; the aten path elsewhere; a call
whose signature, ``_signature``, was seen runs what the first one derived, skipping validation and the choice); fake:
shapes only. ``eager_moe_mlp`` is the entry for eager callers: plain calls skip those layers.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import compat, config
from ..activations import ACTIVATIONS, get_activation
from ..kernels.common import next_power_of_2

log = logging.getLogger("mlp_fuser")

_lib = torch.library.Library("mlp_fuser", "FRAGMENT")
_lib.define(
    "moe_mlp(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor? b_gate_up, Tensor w_down, "
    "Tensor? b_down, str activation, bool interleaved=False, float? limit=None, bool clamp_after=False, "
    "float up_offset=0.0) -> Tensor")

_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_INT = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
# Checking ids for negative values reads them on the host: on CUDA only where asked (a sync per call otherwise).


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


# ---- validation ---------------------------------------------------------------------------------------


def _shape(t) -> str:
    return "None" if t is None else f"({', '.join(str(s) for s in t.shape)})"


def check_args(x, ids, wts, wgu, bgu, wd, bd, activation) -> None:
    """Raise TypeError / ValueError naming the argument when a call breaks a rule."""
    problem = _problem(x, ids, wts, wgu, bgu, wd, bd, activation)
    if problem is not None:
        exc, msg = problem
        shapes = ", ".join(f"{n}={_shape(t)}" for n, t in zip(
            ("x", "topk_ids", "topk_weights", "w_gate_up", "b_gate_up", "w_down", "b_down"),
            (x, ids, wts, wgu, bgu, wd, bd)))
        raise exc(f"mlp_fuser::moe_mlp: {msg} (shapes: {shapes})")


def _problem(x, ids, wts, wgu, bgu, wd, bd, activation):
    try:
        get_activation(activation)
    except (TypeError, ValueError) as e:
        return type(e), f"argument 'activation': {str(e).removeprefix('mlp_fuser: ')}"
    if x.dtype not in _FLOAT:
        return TypeError, f"x has dtype {x.dtype}; expected one of float16, bfloat16, float32, float64"
    if x.dim() < 1:
        return ValueError, "x must have at least one dimension (its last is the hidden size)"
    if ids.dtype not in _INT:
        return TypeError, f"topk_ids has dtype {ids.dtype}; expected an integer dtype (expert ids)"
    if not wts.is_floating_point():
        return TypeError, f"topk_weights has dtype {wts.dtype}; expected a floating dtype (routing weights)"
    for name, t, dims in (("w_gate_up", wgu, 3), ("b_gate_up", bgu, 2), ("w_down", wd, 3), ("b_down", bd, 2)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            return TypeError, f"{name} has dtype {t.dtype} but x has dtype {x.dtype}"
        if t.dim() != dims:
            return ValueError, f"{name} must have {dims} dimensions, got {t.dim()}"
    for name, t in (("topk_ids", ids), ("topk_weights", wts), ("w_gate_up", wgu), ("w_down", wd), ("b_gate_up", bgu),
                    ("b_down", bd)):
        if t is not None and t.device != x.device:
            return ValueError, f"{name} is on {t.device} but x is on {x.device}"
    H, tokens = x.shape[-1], x.shape[:-1]
    E, N, K = wgu.shape
    if K != H:
        return ValueError, f"w_gate_up takes {K} input features but x has {H} (its last dimension)"
    if wd.shape[0] != E:
        return ValueError, f"w_down has {wd.shape[0]} experts but w_gate_up has {E}"
    if wd.shape[1] != H:
        return ValueError, f"w_down has {wd.shape[1]} output features but x has {H}"
    I = wd.shape[2]
    if N not in (I, 2 * I):
        return ValueError, f"w_gate_up has {N} rows per expert; expected 2·I = {2 * I} (gated) or I = {I} (plain)"
    if ids.dim() != len(tokens) + 1 or tuple(ids.shape[:-1]) != tuple(tokens):
        return ValueError, f"topk_ids must be x.shape[:-1] + (k,), got {tuple(ids.shape)}"
    if tuple(wts.shape) != tuple(ids.shape):
        return ValueError, f"topk_weights must have topk_ids' shape {tuple(ids.shape)}, got {tuple(wts.shape)}"
    for name, b, size in (("b_gate_up", bgu, N), ("b_down", bd, H)):
        if b is not None and tuple(b.shape) != (E, size):
            return ValueError, f"{name} must be ({E}, {size}), got {tuple(b.shape)}"
    return None


def _check_ids(ids: Tensor) -> None:
    """Ids below zero are no expert and no sentinel: an error, where reading them costs no host sync."""
    if (ids.numel() and (not ids.is_cuda or config.check_routing) and not torch.compiler.is_compiling()
            and (type(ids) is Tensor or not compat.is_fake(ids))):  # a plain tensor is never fake: no is_fake call
        low = int(ids.min())
        if low < 0:
            raise ValueError(f"mlp_fuser::moe_mlp: topk_ids holds {low}; expert ids are 0..E-1, and ids >= E "
                             "(expert-parallel sentinels) contribute nothing")


# ---- the aten path: sorted by expert, one GEMM per expert (torch._grouped_mm where it runs) -----------------


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


def reference(x, ids, wts, wgu, bgu, wd, bd, gate: Gate) -> Tensor:
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


# ---- implementations and the choice among them ---------------------------------------------------------


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


ImplFn = Callable[..., Tensor]  # (x2, ids2, wts2, wgu, bgu, wd, bd, gate) -> y2 (T, H)


@dataclass(frozen=True)
class Impl:
    name: str
    fn: ImplFn
    devices: frozenset[str] | None
    dtypes: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16, torch.float32})
    triton: bool = False
    why: Callable[[Problem], str | None] | None = None  # any further constraint, as a reason
    worth: Callable[[Problem], str | None] | None = None  # where it runs but is not worth timing (forcing runs it)
    # args -> a function of the seven tensors computing fn(*args) for any call with args' signature (``_signature``)
    plan: Callable[[tuple], Callable[..., Tensor]] | None = None

    def runner(self, args: tuple) -> Callable[..., Tensor]:
        """``fn`` for calls with ``args``' signature, as a function of (x2, ids2, wts2, wgu, bgu, wd, bd)."""
        if self.plan is not None:
            return self.plan(args)
        fn, gate = self.fn, args[-1]
        return lambda x, ids, wts, wgu, bgu, wd, bd: fn(x, ids, wts, wgu, bgu, wd, bd, gate)

    def why_not(self, p: Problem) -> str | None:
        devices = None if self.devices is None else set(self.devices) | (
            {"cpu"} if self.triton and config.triton_on_cpu else set())
        if devices is not None and p.device not in devices:
            return f"device {p.device} not in {sorted(devices)}"
        if p.dtype not in self.dtypes:
            return f"dtype {p.dtype} not supported"
        return self.why(p) if self.why is not None else None


def _triton(path: str) -> ImplFn:
    """The Triton kernels (``kernels/moe.py``) through one of their paths."""
    def impl(x, ids, wts, wgu, bgu, wd, bd, gate: Gate):
        from ..kernels import moe as kmoe  # imported on first use: nothing is compiled before

        return kmoe.moe_experts(x, ids, wts, wgu, bgu, wd, bd, _expert_act(gate), gate.interleaved, path)
    return impl


def _triton_plan(path: str) -> Callable[[tuple], Callable[..., Tensor]]:
    """``kernels.moe.experts_plan`` for one of the paths: the launches' integer arguments worked out once."""
    def plan(args):
        from ..kernels import moe as kmoe

        gate = args[-1]
        return kmoe.experts_plan(*args[:-1], _expert_act(gate), gate.interleaved, path)
    return plan


@functools.lru_cache(maxsize=256)
def _expert_act(gate: Gate):
    from ..kernels import moe as kmoe

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
    from ..kernels import moe as kmoe

    return kmoe.tma_shape_why_not(torch.device(p.device), p.dtype, p.H, p.I, p.gate.interleaved)


def _many_rows(p: Problem) -> str | None:
    from ..kernels import moe as kmoe

    if not config.moe_tma:
        return "off by default: lighter on the GPU, heavier on the host (MLP_FUSER_MOE_TMA=1 times it)"
    if kmoe.rows_bucket(p.T, p.k, p.E) == 128:  # more than 96 rows per touched expert
        return None
    return f"{p.T * p.k} pairs over {min(p.E, p.T * p.k)} experts: <= 96 rows each (TMA measured at about 128)"


def _grouped_mm_ok(p: Problem) -> str | None:
    if compat.grouped_mm is None:
        return "torch has no grouped_mm"
    if p.H % 8 or p.I % 8:
        return "H and I must be multiples of 8"
    return None


IMPLS: list[Impl] = [  # in priority order: without timing (MLP_FUSER_AUTOTUNE=0) the first eligible runs
    Impl("triton_moe_sorted", _triton("sorted"), frozenset({"cuda"}), triton=True,
         plan=_triton_plan("sorted")),
    Impl("triton_moe_sorted_fused", _triton("sorted_fused"), frozenset({"cuda"}), triton=True,
         plan=_triton_plan("sorted_fused")),
    Impl("triton_moe_pairs", _triton("pairs"), frozenset({"cuda"}), triton=True,
         plan=_triton_plan("pairs"), worth=_few_pairs),
    Impl("triton_moe_unsorted", _triton("unsorted"), frozenset({"cuda"}), triton=True,
         plan=_triton_plan("unsorted"), worth=_one_token),
    Impl("triton_moe_unsorted_pdl", _triton("unsorted_pdl"), frozenset({"cuda"}), triton=True,  # Hopper: down overlaps
         plan=_triton_plan("unsorted_pdl"), worth=_one_token),
    Impl("triton_moe_sorted_tma", _triton("sorted_tma"), frozenset({"cuda"}), triton=True,  # weights by TMA
         plan=_triton_plan("sorted_tma"), why=_tma_ok, worth=_many_rows),
    Impl("grouped_mm", reference, frozenset({"cuda"}), frozenset({torch.bfloat16}), why=_grouped_mm_ok),
    Impl("reference", reference, None, _FLOAT),
]
IMPLS_BY_NAME = {i.name: i for i in IMPLS}

@dataclass(frozen=True)
class Choice:
    """The implementation for plain calls (the fastest with the host's time: eager, or compiled code without CUDA
    graphs) and the one for calls captured in a CUDA graph (the fastest on the GPU alone: replays cost no host time)."""
    plain: Impl
    graph: Impl

    @property
    def name(self) -> str:
        return self.plain.name if self.plain is self.graph else f"{self.plain.name} (graphs: {self.graph.name})"


_chosen: dict[tuple, Choice] = {}


def eligible(p: Problem) -> list[Impl]:
    if config.force_impl in IMPLS_BY_NAME:
        impl = IMPLS_BY_NAME[config.force_impl]
        reason = impl.why_not(p)
        if reason is not None:
            raise ValueError(f"mlp_fuser: forced implementation {impl.name!r} cannot run {p}: {reason}")
        return [impl]
    return [i for i in IMPLS if i.why_not(p) is None and (i.worth is None or i.worth(p) is None)]


def _choice_key(p: Problem) -> tuple:
    return (p.device, p.dtype, p.bucket, p.k, p.E, p.H, p.I, p.gate, p.biases, config.force_impl, config.triton_on_cpu,
            config.autotune, config.moe_tma)


def choose(p: Problem, args: tuple) -> Impl:
    """The implementation for ``p``: the only eligible one, or on CUDA the fastest of them, timed once per bucket of
    T on the call's own routing, both with the host's time and on the GPU alone; a call being captured in a CUDA graph
    takes the latter (before any warm-up call chose: the aten path, as timing cannot run inside a capture)."""
    key = _choice_key(p)
    capturing = p.device == "cuda" and torch.cuda.is_current_stream_capturing()
    choice = _chosen.get(key)
    if choice is not None:
        return choice.graph if capturing else choice.plain
    candidates = eligible(p)
    if len(candidates) == 1 or p.device != "cuda" or not config.autotune:
        choice = Choice(candidates[0], candidates[0])
    elif capturing:
        log.warning("mlp_fuser: first moe_mlp call for %s inside a CUDA-graph capture: running the aten path; call "
                    "the model once before capturing", p)
        return IMPLS_BY_NAME["reference"]
    else:
        choice = _time(candidates, args, p)
    _chosen[key] = choice
    return choice.plain


def _time(candidates: list[Impl], args: tuple, p: Problem) -> Choice:
    """The candidates with the least time per call, median of 7 interleaved rounds of 3 calls, warm-up failures
    skipped: wall time between syncs (the host's time included), and GPU time with the calls queued behind a sleep
    kernel (so that the host's time is hidden, as in a CUDA graph's replay)."""
    runnable = []
    for impl in candidates:
        if impl.name == "reference" and len(candidates) > 1:
            continue
        try:
            impl.fn(*args)
            impl.fn(*args)
            runnable.append(impl)
        except Exception as e:  # a kernel that cannot compile for this shape is not chosen; say so
            log.warning("mlp_fuser: %s skipped for %s: %s: %s", impl.name, p, type(e).__name__, e)
    if not runnable:
        ref = IMPLS_BY_NAME["reference"]
        return Choice(ref, ref)
    wall: dict[str, list[float]] = {i.name: [] for i in runnable}
    gpu: dict[str, list] = {i.name: [] for i in runnable}
    for _ in range(7):
        for impl in runnable:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                impl.fn(*args)
            torch.cuda.synchronize()
            wall[impl.name].append((time.perf_counter() - t0) * 1e3)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            compat.gpu_sleep(10_000_000)  # a few ms: longer than the host takes to queue the three calls
            start.record()
            for _ in range(3):
                impl.fn(*args)
            end.record()
            gpu[impl.name].append((start, end))
    torch.cuda.synchronize()
    med_wall = {n: sorted(ts)[len(ts) // 2] / 3 for n, ts in wall.items()}
    med_gpu = {n: sorted(s.elapsed_time(e) for s, e in pairs)[len(pairs) // 2] / 3 for n, pairs in gpu.items()}
    choice = Choice(min(runnable, key=lambda i: med_wall[i.name]), min(runnable, key=lambda i: med_gpu[i.name]))
    log.info("mlp_fuser: chose %s for moe_mlp %s (µs per call, wall / GPU: %s)", choice.name, p,
             ", ".join(f"{n} {med_wall[n] * 1e3:.1f} / {med_gpu[n] * 1e3:.1f}" for n in med_wall))
    return choice


def chosen(p: Problem) -> str | None:
    """The name of the implementation chosen for ``p`` so far (for plain calls, and for CUDA graphs where that
    differs), or None."""
    for key, choice in _chosen.items():
        if key[:9] == (p.device, p.dtype, p.bucket, p.k, p.E, p.H, p.I, p.gate, p.biases):
            return choice.name
    return None


def reset() -> None:
    _chosen.clear()
    _EAGER.clear()


# ---- the op's kernels ------------------------------------------------------------------------------------------


def _gate(w_gate_up: Tensor, w_down: Tensor, activation, interleaved, limit, clamp_after, up_offset) -> Gate:
    return Gate(get_activation(activation).name, w_gate_up.shape[1] == 2 * w_down.shape[2], bool(interleaved),
                None if limit is None else float(limit), bool(clamp_after), float(up_offset))


_EAGER: dict[tuple, tuple] = {}  # _signature -> (plain runner, graph runner, on CUDA, check ids, flatten, T, k, H)
_MAX_EAGER = 4096  # a process that sees endless new shapes starts afresh rather than growing the dict


def _signature(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset) -> tuple:
    """The key of a call: everything ``_problem`` checks and ``choose`` keys on, and what the kernels' integer
    arguments are built from: each tensor's shape, strides, dtype and device, the activation and its options, the
    settings. Equal signatures: the full path would accept both calls and run the same kernels with the same integers
    (the data pointers' alignment, which Triton also specialises on, is the launches' own key)."""
    return (activation, interleaved, limit, clamp_after, up_offset, config.force_impl, config.autotune,
            config.moe_tma, config.triton_on_cpu, x.dtype is torch.float32 and torch.backends.cuda.matmul.allow_tf32,
            x.shape, x.stride(), x.dtype, x.device, ids.shape, ids.stride(), ids.dtype, ids.device,
            wts.shape, wts.stride(), wts.dtype, wts.device, wgu.shape, wgu.stride(), wgu.dtype, wgu.device,
            wd.shape, wd.stride(), wd.dtype, wd.device,
            None if bgu is None else (bgu.shape, bgu.stride(), bgu.dtype, bgu.device),
            None if bd is None else (bd.shape, bd.stride(), bd.dtype, bd.device))


def _forward(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved=False, limit=None, clamp_after=False,
             up_offset=0.0):
    """The op on real tensors: a signature seen before runs what the full path (``_forward_full``) derived for it,
    skipping validation, the choice's key and the kernels' argument building; only the ids' check is per call."""
    try:
        key = _signature(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset)
        hit = _EAGER.get(key)
    except TypeError:  # an unhashable argument, of a wrong type: the full path names it
        key = hit = None
    if hit is None:
        return _forward_full(key, x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after,
                             up_offset)
    plain, graph, cuda, check, flat, T, k, H = hit
    if check or config.check_routing:
        _check_ids(ids)
    run = graph if cuda and torch.cuda.is_current_stream_capturing() else plain
    if not flat:
        return run(x, ids, wts, wgu, bgu, wd, bd)
    return run(x.reshape(T, H), ids.reshape(T, k), wts.reshape(T, k), wgu, bgu, wd, bd).view(x.shape)


def _forward_full(key, x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset):
    """Validation, the choice, the implementation; then, once the choice is made, the signature's entry."""
    check_args(x, ids, wts, wgu, bgu, wd, bd, activation)
    _check_ids(ids)
    H = x.shape[-1]
    T = math.prod(x.shape[:-1])
    if T == 0:
        return x.new_zeros((*x.shape[:-1], H))
    k = ids.shape[-1]
    x2, ids2, wts2 = x.reshape(T, H), ids.reshape(T, k), wts.reshape(T, k)
    gate = _gate(wgu, wd, activation, interleaved, limit, clamp_after, up_offset)
    p = Problem(x.device.type, x.dtype, T, k, wgu.shape[0], H, wd.shape[2], gate, bgu is not None or bd is not None)
    args = (x2, ids2, wts2, wgu, bgu, wd, bd, gate)
    y = choose(p, args).fn(*args)
    choice = _chosen.get(_choice_key(p))
    if key is not None and choice is not None:  # none while a capture ran the aten path before any choice
        plain = choice.plain.runner(args)
        graph = plain if choice.graph is choice.plain else choice.graph.runner(args)
        if len(_EAGER) >= _MAX_EAGER:
            _EAGER.clear()
        _EAGER[key] = (plain, graph, x.is_cuda, not x.is_cuda and ids.numel() > 0, x.dim() != 2 or ids.dim() != 2,
                       T, k, H)
    return y.view(*x.shape[:-1], H)


_lib.impl("moe_mlp", _forward, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::moe_mlp")
def _fake(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved=False, limit=None, clamp_after=False, up_offset=0.0):
    check_args(x, ids, wts, wgu, bgu, wd, bd, activation)
    return x.new_empty(x.shape)


def _autograd(keyset, x, ids, wts, wgu, bgu, wd, bd, activation, interleaved=False, limit=None, clamp_after=False,
              up_offset=0.0):
    if torch.is_grad_enabled() and compat.any_requires_grad(x, wts, wgu, bgu, wd, bd):
        check_args(x, ids, wts, wgu, bgu, wd, bd, activation)
        _check_ids(ids)
        gate = _gate(wgu, wd, activation, interleaved, limit, clamp_after, up_offset)
        H, k = x.shape[-1], ids.shape[-1]
        T = math.prod(x.shape[:-1])
        y = reference(x.reshape(T, H), ids.reshape(T, k), wts.reshape(T, k), wgu, bgu, wd, bd, gate)
        return y.view(x.shape)
    with compat.below_autograd():
        return torch.ops.mlp_fuser.moe_mlp.default.redispatch(
            keyset & compat.AFTER_AUTOGRAD, x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit,
            clamp_after, up_offset)


_lib.impl("moe_mlp", _autograd, "Autograd", with_keyset=True)


def _register_autocast(device_type: str) -> None:
    key_name = compat.autocast_key(device_type)
    op = torch.ops.mlp_fuser.moe_mlp.default

    def kernel(_keyset, x, ids, wts, wgu, bgu, wd, bd, *rest):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(a):
            return a.to(dtype) if a is not None and a.is_floating_point() and a.device.type == device_type else a

        with compat.excluding(key_name):
            return op(cast(x), ids, wts, cast(wgu), cast(bgu), cast(wd), cast(bd), *rest)

    _lib.impl("moe_mlp", kernel, key_name, with_keyset=True)


for _dev in ("cuda", "cpu"):
    _register_autocast(_dev)


def eager_moe_mlp(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved=False, limit=None, clamp_after=False,
                  up_offset=0.0) -> Tensor:
    """``moe_mlp`` for a caller that runs eagerly (``patch``, the experts switch outside torch.compile): what the op
    computes, minus the dispatcher's layers (autocast, autograd, the op's entry) where nothing needs them."""
    if type(ids) is Tensor and compat.plain_call(x, (wts, wgu, bgu, wd, bd)):
        return _forward(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset)
    return torch.ops.mlp_fuser.moe_mlp.default(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit,
                                               clamp_after, up_offset)


def moe_mlp(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor, b_gate_up: Tensor | None,
            w_down: Tensor, b_down: Tensor | None, activation: str, interleaved: bool = False,
            limit: float | None = None, clamp_after: bool = False, up_offset: float = 0.0) -> Tensor:
    """Routed experts as one op: ``torch.ops.mlp_fuser.moe_mlp`` (see the module's docstring)."""
    return torch.ops.mlp_fuser.moe_mlp.default(x, topk_ids, topk_weights, w_gate_up, b_gate_up, w_down, b_down,
                                               activation, interleaved, limit, clamp_after, up_offset)
