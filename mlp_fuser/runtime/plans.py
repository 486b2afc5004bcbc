"""Launch plans: the op's CUDA call for one exact signature, reduced to its allocations and launches.

The first call of the op with a signature runs the full path (validation, the dispatcher's choice, the
implementation, whose Triton launches go through ``Launcher``, compiling and autotuning the very first time) and
records those launches. ``build`` turns the record into a plan: one generated function that allocates the output and
one workspace for every intermediate, then hands each compiled kernel its arguments as plain integers, the data
pointers included (Triton's launcher takes an integer as a device pointer, skipping the ``data_ptr()`` call and the
driver's pointer query it makes for a tensor), through Triton's C launch function itself where
``compat.launch_source`` knows its form; cuBLAS is handed 2-D tensors. ``source(plan)`` shows what a plan runs.

This module builds plans; the dispatcher (``dispatch/dense.py``) keeps them, beside its choices, keyed by the call's
signature, and a later call with that signature runs the plan: no dispatch, no launch keys. A signature holds
everything the call's validity, the dispatcher's choice and the kernels' specialisation depend on: each tensor's
shape, strides, dtype, device and 16-byte alignment, whether gate and up are stored as one weight
(``kernels.common.stored_as_one``: ``cublas_act_mul`` then runs one GEMM for both), the activation, whether the call
is eager (``patch``, which has its own choice) and the settings that change the choice (``config.force_impl``,
``config.autotune``, TF32 for fp32). Equal signatures mean the full path would validate, choose and launch the same
kernels with the same integers; only the data pointers differ, and the plan reads them per call.

Planned implementations: ``triton_gemm_splitk``, ``triton_swapab`` and ``triton_small_m`` (Triton launches only;
small_m's fp32 calls without b_down, which return its accumulator, are not planned: that output must start at zero),
``triton_gemm`` (a Triton launch, then cuBLAS for the down projection) and ``cublas_act_mul`` (cuBLAS for gate and
up, the act·mul launch, cuBLAS for down: the choice at prefill sizes, where a patched model's host time can still
decide). The reference takes the full path on every call, and so does every call while a Triton launch hook (a
profiler) is set: those must go through Triton.

Training through ``patch`` has two plans of its own, kept per signature beside the forward's (the dispatcher's
``SAVING_PLANS`` and ``BACKWARD_PLANS``): the save-mode forward (cuBLAS gate and up, act·mul, cuBLAS down, returning
g and u for the backward: ``build_saving``), and the backward with the default implementation (cuBLAS dh, the
act'·mul epilogue as one launch, the weight and input gradients as cuBLAS calls: ``build_backward``). The backward's
signature is the forward's, the gradients asked for and dy's metadata; the opt-in Triton dh GEMM and the reference
take the full path.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import Tensor

from .. import compat
from ..compat import launch_source
from ..kernels.backward import act_mul_backward_launcher
from ..kernels.common import Launcher

# name -> (how the workspace starts: "empty" or "zeros", what cuBLAS runs around the launches: "" nothing, "down" the
# down projection after them, "all" gate and up before them (the launch is act·mul) and down after)
PLANNED = {"triton_gemm_splitk": ("empty", ""), "triton_swapab": ("empty", ""), "triton_small_m": ("zeros", ""),
           "triton_gemm": ("empty", "down"), "cublas_act_mul": ("empty", "all")}
_ALIGN = 256  # bytes between the starts of the workspace's pieces (the kernels were specialised on 16)
_INPUTS = ("x", "wg", "bg", "wu", "bu", "wd", "bd")  # the tensors of dispatch.MLPArgs: what a plan takes
_HEAD = f"def plan({', '.join(_INPUTS)}):"


@contextlib.contextmanager
def recording():
    """``with recording() as launches``: the launches made meanwhile on this thread, as ``Launcher`` records them
    (a context, not a callback: the caller's own code runs inside, and nothing here calls back up into it)."""
    Launcher.recording.launches = launches = []
    try:
        yield launches
    finally:
        Launcher.recording.launches = None


def recorded(fn: Callable, *args):
    """(``fn(*args)``, the launches it made, as ``Launcher`` records them for this thread)."""
    with recording() as launches:
        return fn(*args), launches


def record(name: str, fn: Callable[..., Tensor], x: Tensor, args: tuple) -> tuple[Tensor, Callable[..., Tensor] | None]:
    """``fn(*args)`` (implementation ``name`` on the call's ``dispatch.MLPArgs``, x flattened to 2-D) and the plan
    built from the launches it made (None where ``build`` gives none)."""
    y, launches = recorded(fn, *args)
    return y, build(name, x, args, y, launches)


def source(plan: Callable[..., Tensor]) -> str:
    return plan.__source__


def build(name: str, x: Tensor, args: tuple, y: Tensor, launches: list) -> Callable[..., Tensor] | None:
    """The plan for implementation ``name`` from one call: ``args`` its 2-D arguments, ``y`` (M, O) what it returned,
    ``launches`` its launches as ``Launcher`` recorded them. None where a plan could not reproduce the call exactly
    (not a planned implementation, a launch that was not compiled, a tensor it cannot account for)."""
    if name not in PLANNED or not launches or compat.launch_hooks():
        return None
    start, cublas = PLANNED[name]
    x2, wg, wd = args.x, args.wg, args.wd
    if x2.data_ptr() != x.data_ptr():  # x2 must be a view of x: the plan passes x's pointer
        return None
    if cublas == "all":
        return _build_cublas_act_mul(name, x, args, launches)
    cublas_tail = cublas == "down"
    names = {id(t): n for n, t in zip(_INPUTS, args) if t is not None}
    out_shape = (*x.shape[:-1], wd.shape[0])
    pieces: dict[int, tuple[str, int, int]] = {}  # id(intermediate) -> (expression, byte offset, bytes)
    nbytes, calls, consts, used = 0, [], {}, set()
    for i, (launcher, key, largs) in enumerate(launches):
        hit = launcher.cache.get(key)
        if hit is None:
            return None
        device_index = hit[2]
        exprs = []
        for a in largs:
            if isinstance(a, Tensor):
                if id(a) in names:
                    exprs.append(f"p_{names[id(a)]}")
                    used.add(names[id(a)])
                elif a is y and not cublas_tail:
                    if start == "zeros" and i == 0:  # the first launch accumulates: into a zeroed output, not this
                        return None
                    exprs.append("p_y")
                elif id(a) in pieces:
                    exprs.append(pieces[id(a)][0])
                else:  # an intermediate: a fresh, contiguous allocation of its own, placed in the workspace
                    view = compat.view_base(a) is not None
                    if not a.is_contiguous() or view or a.untyped_storage().nbytes() != a.nbytes:
                        return None
                    pieces[id(a)] = (f"(w + {nbytes})" if nbytes else "w", nbytes, a.nbytes)
                    exprs.append(pieces[id(a)][0])
                    nbytes += -(-a.nbytes // _ALIGN) * _ALIGN
            elif (literal := _literal(a)) is not None:
                exprs.append(literal)
            else:
                return None
        calls.append(_launch_line(i, launcher, hit, exprs, consts))
    lines = [_HEAD, f"    s = _stream({device_index})"]
    lines += [f"    p_{n} = {n}.data_ptr()" for n in _INPUTS if n in used]
    if cublas_tail:  # the launches write h (the only intermediate), which cuBLAS then reads as a tensor
        h_shape = (x2.shape[0], wg.shape[0])
        if [p[1:] for p in pieces.values()] != [(0, math.prod(h_shape) * x.element_size())]:
            return None  # not exactly one intermediate of h's size
        lines += [f"    h = _{start}({h_shape}, dtype=_dtype, device=_device)", "    w = h.data_ptr()"]
        lines += calls + [f"    return {_unflatten(_gemm('h', 'wd', 'bd', args.bd), x, out_shape)}"]
    else:
        if not y.is_contiguous() or y.dtype != x.dtype or any(id(y) == k for k in pieces):
            return None
        lines += [f"    y = _empty({out_shape}, dtype=_dtype, device=_device)", "    p_y = y.data_ptr()"]
        if pieces:
            lines += [f"    w = _{start}(({nbytes},), dtype=_u8, device=_device).data_ptr()"]
        lines += calls + ["    return y"]
    return _compile(name, lines, consts, x)


def build_saving(x: Tensor, args: tuple, launches: list) -> Callable[..., tuple] | None:
    """The save-mode forward's plan from one call of ``dispatch.dense_training.forward_saving`` (``args`` its
    ``dispatch.MLPArgs``, x flattened to 2-D; ``launches`` its act·mul launch):
    ``plan(x, wg, bg, wu, bu, wd, bd) -> (y, g, u)``."""
    if not launches or compat.launch_hooks() or args.x.data_ptr() != x.data_ptr():
        return None
    return _build_cublas_act_mul("save", x, args, launches, keep_preact=True)


_BACKWARD_HEAD = "def plan(dy, x, wg, bg, wu, bu, wd, bd, g=None, u=None):"


def build_backward(need: tuple, dy: Tensor, a: tuple, g: Tensor | None, u: Tensor | None,
                   launches: list) -> Callable[..., tuple] | None:
    """The backward's plan from one call of ``dispatch.dense_training.backward_core`` (``need``, ``dy``, ``a`` and
    the saved g, u it was given, None where it recomputed them; ``launches`` what it launched):
    ``plan(dy, *a[:7], g, u)`` returns the same seven gradients from the same aten calls and the same launch, minus
    the checks, the dispatcher's lookup and the launch keys. None unless the record is the default implementation's
    one launch (``cublas_backward_act``: cuBLAS dh, then the act'·mul epilogue over the contiguous g and u)."""
    x, wg, bg, wu, bu, wd, bd = a[:7]
    gated, need_h = wu is not None, need[5]
    K, I, O = x.shape[-1], wg.shape[0], wd.shape[0]
    M = math.prod(x.shape[:-1])
    if len(launches) != 1 or compat.launch_hooks() or M == 0 or I == 0:
        return None
    launcher, key, largs = launches[0]
    hit = launcher.cache.get(key)
    if launcher is not act_mul_backward_launcher or hit is None or len(largs) != 7 or largs[5:] != (M * I, I):
        return None
    dh, lg, lu, dgu, h = largs[:5]
    if (g is not None and (lg is not g or lu is not (u if gated else g))) or dh.shape != (M, I) \
            or dgu.shape != (M, 2 * I if gated else I) or (h is dgu) == need_h:
        return None
    s = "    "
    lines = [_BACKWARD_HEAD, f"{s}s = _stream({hit[2]})",
             f"{s}dy2 = dy.reshape({(M, O)})" if dy.dim() != 2 else f"{s}dy2 = dy",
             f"{s}x2 = x.reshape({(M, K)})" if x.dim() != 2 else f"{s}x2 = x"]
    if g is None:  # recomputed, as the full path does
        lines.append(f"{s}g = {_gemm('x2', 'wg', 'bg', bg)}")
        if gated:
            lines.append(f"{s}u = {_gemm('x2', 'wu', 'bu', bu)}")
    lines += [f"{s}dh = _mm(dy2, wd)",
              f"{s}dgu = _empty({tuple(dgu.shape)}, dtype=_dtype, device=_device)",
              f"{s}h = _empty({(M, I)}, dtype=_dtype, device=_device)" if need_h else f"{s}h = dgu"]
    exprs = ["dh.data_ptr()", "g.data_ptr()", ("u" if gated else "g") + ".data_ptr()", "dgu.data_ptr()",
             "h.data_ptr()", repr(M * I), repr(I)]
    consts: dict = {}
    lines.append(_launch_line(0, launcher, hit, exprs, consts))
    lines.append(f"{s}del dh, g, u")  # recomputed ones are freed before the GEMMs below allocate
    grads = dict.fromkeys(("dx", "dwg", "dbg", "dwu", "dbu", "dwd", "dbd"), "None")
    if need_h:
        lines.append(f"{s}dwd = _mm(dy2.t(), h)")
        grads["dwd"] = "dwd"
    lines.append(f"{s}del h")
    if bd is not None and need[6]:
        lines.append(f"{s}dbd = dy2.sum(0)")
        grads["dbd"] = "dbd"
    lines.append(f"{s}dg = dgu.narrow(1, 0, {I})")
    if gated:
        lines.append(f"{s}du = dgu.narrow(1, {I}, {I})")
    if need[0]:
        dx = "_addmm(_mm(dg, wg), du, wu)" if gated else "_mm(dg, wg)"
        lines.append(f"{s}dx = {dx}.view({tuple(x.shape)})")
        grads["dx"] = "dx"
    if gated and need[1] and need[3]:  # d(w_gate | w_up) in one GEMM over the packed gradient
        lines += [f"{s}dwgu = _mm(dgu.t(), x2)", f"{s}dwg = dwgu.narrow(0, 0, {I})",
                  f"{s}dwu = dwgu.narrow(0, {I}, {I})"]
        grads.update(dwg="dwg", dwu="dwu")
    else:
        if need[1]:
            lines.append(f"{s}dwg = _mm(dg.t(), x2)")
            grads["dwg"] = "dwg"
        if gated and need[3]:
            lines.append(f"{s}dwu = _mm(du.t(), x2)")
            grads["dwu"] = "dwu"
    if bg is not None and bu is not None and need[2] and need[4]:
        lines += [f"{s}dbgu = dgu.sum(0)", f"{s}dbg = dbgu.narrow(0, 0, {I})", f"{s}dbu = dbgu.narrow(0, {I}, {I})"]
        grads.update(dbg="dbg", dbu="dbu")
    else:
        if bg is not None and need[2]:
            lines.append(f"{s}dbg = dg.sum(0)")
            grads["dbg"] = "dbg"
        if gated and bu is not None and need[4]:
            lines.append(f"{s}dbu = du.sum(0)")
            grads["dbu"] = "dbu"
    lines.append(f"{s}return {', '.join(grads.values())}")
    return _compile("backward", lines, consts, dy)


def _literal(a) -> str | None:
    """Source that evaluates back to ``a``, a launch's argument that is not a tensor; None where there is none."""
    if a is None or type(a) in (int, bool) or (type(a) is float and math.isfinite(a)):
        return repr(a)
    return None


def _launch_line(i: int, launcher: Launcher, hit: tuple, exprs: list[str], consts: dict) -> str:
    """The plan's line for its launch number ``i``: ``hit`` the launcher's cache entry (compiled kernel, grid, device),
    ``exprs`` the source of each argument; the compiled kernel's handles go into ``consts``."""
    compiled, grid = hit[:2]
    return "    " + launch_source(compiled, grid, "s", [*exprs, *["None"] * len(launcher.pad)], f"_k{i}_", consts)


def _compile(name: str, lines: list[str], consts: dict, x: Tensor) -> Callable[..., Tensor]:
    """The plan function from its source lines; ``consts`` the compiled kernels' launchers and handles it calls."""
    text = "\n".join(lines) + "\n"
    namespace = dict(consts, _stream=compat.current_stream, _empty=torch.empty, _zeros=torch.zeros, _mm=torch.mm,
                     _addmm=torch.addmm,
                     _dtype=x.dtype, _device=x.device, _u8=torch.uint8)
    exec(compile(text, f"<mlp_fuser plan: {name}>", "exec"), namespace)  # noqa: S102 (source built above)
    plan = namespace["plan"]
    plan.__source__ = text
    return plan


def _build_cublas_act_mul(name: str, x: Tensor, args: tuple, launches: list,
                          keep_preact: bool = False) -> Callable[..., Tensor] | None:
    """The plan of ``cublas_act_mul``: g = x @ w_gateᵀ + b_gate and u (cuBLAS, tensors of the call's own; where gate
    and up are stored as one weight, one GEMM gives gu = [g, u] and g, u are its halves), then its one launch,
    act·mul, whose first three tensor arguments are g, u (g again without up) and h, then cuBLAS for the down
    projection of h. None where the record is not that one launch. ``keep_preact``: the plan returns (y, g, u), g
    and u as two tensors of their own (u None without up), as ``dispatch.dense_training.forward_saving`` does."""
    x2, wg, wu, wd = args.x, args.wg, args.wu, args.wd
    if len(launches) != 1:
        return None
    launcher, key, largs = launches[0]
    hit = launcher.cache.get(key)
    tensors = [a for a in largs if isinstance(a, Tensor)]
    h_shape = (x2.shape[0], wg.shape[0])
    if hit is None or len(tensors) != 3 or any(t.shape != h_shape for t in tensors):
        return None
    g, u, h = tensors
    # one GEMM: g and u the halves of one (M, 2I) result, as runtime.dense.cublas_act_mul makes them (merged weight)
    gu = compat.view_base(g)
    one = (wu is not None and gu is not None and gu is compat.view_base(u) and gu.is_contiguous()
           and gu.shape == (h_shape[0], 2 * h_shape[1]) and g.data_ptr() == gu.data_ptr()
           and u.data_ptr() - g.data_ptr() == h_shape[1] * g.element_size())
    if not (one or (g.is_contiguous() and u.is_contiguous())) or not h.is_contiguous() or (one and keep_preact):
        return None
    if (u is g) != (wu is None) or h is g or h is u:
        return None
    names = {id(g): "p_g", id(u): "p_u", id(h): "p_h"}
    exprs = [names[id(a)] if isinstance(a, Tensor) else _literal(a) for a in largs]
    if None in exprs:
        return None
    consts: dict = {}
    out_shape = (*x.shape[:-1], wd.shape[0])
    lines = [_HEAD, f"    s = _stream({hit[2]})",
             f"    x2 = x.view({tuple(x2.shape)})" if x.dim() != 2 else "    x2 = x"]
    if one:  # the signature says the weights are stored as one: their (2I, K) view, as gate_up_as_one takes it
        lines += [f"    gu = _mm(x2, wg.as_strided({(2 * wg.shape[0], wg.shape[1])}, {wg.stride()}).t())",
                  "    p_g = gu.data_ptr()", f"    p_u = p_g + {u.data_ptr() - g.data_ptr()}"]
    else:
        lines += [f"    g = {_gemm('x2', 'wg', 'bg', args.bg)}", "    p_g = g.data_ptr()"]
        # u held in a name until the launch is queued: freed earlier, its memory could become h's
        up = [f"    u = {_gemm('x2', 'wu', 'bu', args.bu)}", "    p_u = u.data_ptr()"]
        lines += up if wu is not None else ["    p_u = p_g"]
    y = _unflatten(_gemm('h', 'wd', 'bd', args.bd), x, out_shape)
    lines += [f"    h = _empty({h_shape}, dtype=_dtype, device=_device)", "    p_h = h.data_ptr()",
              _launch_line(0, launcher, hit, exprs, consts),
              f"    return {y}, g, {'u' if wu is not None else 'None'}" if keep_preact else f"    return {y}"]
    return _compile(name, lines, consts, x)


def _gemm(a: str, w: str, b: str, bias: Tensor | None) -> str:
    """Source of ``F.linear(a, w, b)`` for a 2-D ``a`` (``bias``: b's tensor in the recorded call) as the very aten
    call F.linear makes of it, addmm with a bias and mm without, minus the linear and matmul layers around it: the
    same cuBLAS call for less host time."""
    return f"_mm({a}, {w}.t())" if bias is None else f"_addmm({b}, {a}, {w}.t())"


def _unflatten(expr: str, x: Tensor, out_shape: tuple) -> str:
    """``expr``, a 2-D result, viewed as the call's output shape where x is not 2-D. cuBLAS is handed 2-D tensors
    throughout: F.linear on a 3-D input flattens and unflattens it itself, in aten calls that cost the host about as
    much as the GEMM's own."""
    return expr if x.dim() == 2 else f"{expr}.view({out_shape})"
