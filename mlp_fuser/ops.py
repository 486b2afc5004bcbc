"""The op family ``mlp_fuser::mlp`` and ``mlp_fuser::gated_mlp``, registered through torch.library.

    mlp(x, w1, b1, w2, b2, activation)                       = act(x @ w1ᵀ + b1) @ w2ᵀ + b2
    gated_mlp(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)
        = (act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up)) @ w_downᵀ + b_down

Weights are taken in the logical ``(out, in)`` shape of ``nn.Linear`` with any strides, so every storage
layout is a free view: GPT-2's ``Conv1D`` ``(in, out)`` weight is passed as ``w.t()``, a merged Phi-3
gate/up weight ``(2I, K)`` as ``w[:I]`` and ``w[I:]``. Nothing is copied or transposed per call.
``x`` has any number of leading dimensions; every bias is optional.

Registered kernels, from the top of the dispatcher down:
- autocast (CUDA, CPU): casts the floating inputs to the autocast dtype, as ``nn.Linear`` does;
- autograd: with gradients needed, an autograd.Function whose backward recomputes the intermediate instead of
  saving it; without, a plain CPU or CUDA call is computed right there (the hop down the dispatcher would
  cost more host time than the kernels of a decode step), anything else (fake tensors, functionalization)
  goes on down;
- every device (CompositeExplicitAutograd): ``_forward``, which validates and runs what ``dispatch`` chose;
- fake: shapes only, so torch.compile traces the op with no graph break.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import dispatch
from .activations import ACTIVATIONS, ALIASES, get_activation

_lib = torch.library.Library("mlp_fuser", "DEF")
_lib.define("mlp(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation) -> Tensor")
_lib.define("gated_mlp(Tensor x, Tensor w_gate, Tensor? b_gate, Tensor w_up, Tensor? b_up, Tensor w_down, "
            "Tensor? b_down, str activation) -> Tensor")

_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_KNOWN_ACTIVATIONS = frozenset(ACTIVATIONS) | frozenset(ALIASES)
_NAMES = {True: ("w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down"), False: ("w1", "b1", None, None, "w2", "b2")}


# ---- validation: each rule once, the message built only when it fails -----------------------------------


def _problem(x, wg, bg, wu, bu, wd, bd, activation) -> tuple[type[Exception], str] | None:
    """The first rule a call breaks, as (exception type, message), or None. Runs on every call."""
    if activation not in _KNOWN_ACTIVATIONS:
        try:
            get_activation(activation)
        except (TypeError, ValueError) as e:
            return type(e), f"argument 'activation': {str(e).removeprefix('mlp_fuser: ')}"
    dt, dev = x.dtype, x.device
    if dt not in _FLOAT_DTYPES:
        return TypeError, f"x has dtype {dt}; expected one of float16, bfloat16, float32, float64"
    if x.dim() < 1:
        return ValueError, "x must have at least one dimension (its last is K)"
    names = _NAMES[wu is not None]
    for name, t, dims in zip(names, (wg, bg, wu, bu, wd, bd), (2, 1, 2, 1, 2, 1)):
        if t is None:
            continue
        if t.dtype != dt:
            return TypeError, f"{name} has dtype {t.dtype} but x has dtype {dt}"
        if t.device != dev:
            return ValueError, f"{name} is on {t.device} but x is on {dev}"
        if t.dim() != dims:
            return ValueError, f"{name} must have {dims} dimension(s), got {t.dim()}"
    K, I, O = x.shape[-1], wg.shape[0], wd.shape[0]
    if wg.shape[1] != K:
        return ValueError, f"{names[0]} has {wg.shape[1]} input features but x has {K} (its last dimension)"
    if wu is not None and wu.shape != wg.shape:
        return ValueError, f"w_up must have the shape of w_gate, {_shape(wg)}"
    if wd.shape[1] != I:
        return ValueError, f"{names[4]} has {wd.shape[1]} input features but the intermediate size is {I}"
    for name, b, size in ((names[1], bg, I), (names[3], bu, I), (names[5], bd, O)):
        if b is not None and b.shape[0] != size:
            return ValueError, f"{name} has {b.shape[0]} elements; expected {size}"
    return None


def _shape(t: Tensor | None) -> str:
    return "None" if t is None else f"({', '.join(str(s) for s in t.shape)})"


def check_args(op: str, x, wg, bg, wu, bu, wd, bd, activation) -> None:
    """Raise TypeError/ValueError naming the op, the argument and every shape when a call breaks a rule."""
    problem = _problem(x, wg, bg, wu, bu, wd, bd, activation)
    if problem is not None:
        exc, msg = problem
        named = zip(("x", *_NAMES[wu is not None]), (x, wg, bg, wu, bu, wd, bd))
        shapes = ", ".join(f"{n}={_shape(t)}" for n, t in named if n is not None)
        raise exc(f"mlp_fuser::{op}: {msg} (shapes: {shapes})")


# ---- forward: every device ----------------------------------------------------------------------


def _forward(op: str, x, wg, bg, wu, bu, wd, bd, activation, eager: bool = False):
    """Validate, then run what ``dispatch`` chose for the call's shape (``eager``: its choice for calls made
    without CUDA graphs, where the host's time per call counts too)."""
    check_args(op, x, wg, bg, wu, bu, wd, bd, activation)
    shape = x.shape
    K, O = shape[-1], wd.shape[0]
    if len(shape) == 2:
        M, x2 = shape[0], x
    else:
        M = math.prod(shape[:-1])  # not numel // K, which is 0 rows when K = 0
        x2 = x.reshape(M, K)
    if M == 0:
        return x.new_empty((*shape[:-1], O))
    args = (x2, wg, bg, wu, bu, wd, bd, activation)
    y = dispatch.resolve(x.device, x.dtype, M, K, wg.shape[0], O, wu is not None, args, eager).fn(*args)
    return y if len(shape) == 2 else y.view(*shape[:-1], O)


def _mlp(x, w1, b1, w2, b2, activation):
    return _forward("mlp", x, w1, b1, None, None, w2, b2, activation)


def _gated_mlp(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation):
    return _forward("gated_mlp", x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)


_lib.impl("mlp", _mlp, "CompositeExplicitAutograd")
_lib.impl("gated_mlp", _gated_mlp, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::mlp")
def _mlp_fake(x, w1, b1, w2, b2, activation):
    check_args("mlp", x, w1, b1, None, None, w2, b2, activation)
    return x.new_empty((*x.shape[:-1], w2.shape[0]))


@torch.library.register_fake("mlp_fuser::gated_mlp")
def _gated_mlp_fake(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation):
    check_args("gated_mlp", x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)
    return x.new_empty((*x.shape[:-1], w_down.shape[0]))


def mlp(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, activation: str) -> Tensor:
    """``act(x @ w1ᵀ + b1) @ w2ᵀ + b2``, weights in (out, in) shape: ``torch.ops.mlp_fuser.mlp``."""
    return torch.ops.mlp_fuser.mlp.default(x, w1, b1, w2, b2, activation)


def gated_mlp(x: Tensor, w_gate: Tensor, b_gate: Tensor | None, w_up: Tensor, b_up: Tensor | None, w_down: Tensor,
              b_down: Tensor | None, activation: str) -> Tensor:
    """``(act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up)) @ w_downᵀ + b_down``, weights in (out, in) shape:
    ``torch.ops.mlp_fuser.gated_mlp``."""
    return torch.ops.mlp_fuser.gated_mlp.default(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)


# ---- eager entry: the op without the dispatcher's hop, for calls that need none of its layers ---------

_PLAIN = frozenset({Tensor, torch.nn.Parameter, type(None)})


def _plain_call(args: tuple) -> bool:
    """Whether computing the op right here is exactly what the dispatcher would do: plain CPU/CUDA tensors, no
    gradient, no autocast, no torch function or dispatch mode (fake tensors, functionalization), no tracing; and no
    profiler, which then sees the op's own event."""
    x = args[0]
    return (not torch.compiler.is_compiling() and type(x) is Tensor and x.device.type in ("cuda", "cpu")
            and not torch._C._autograd._profiler_enabled()
            and not (torch.is_grad_enabled() and torch._C._any_requires_grad(*args))
            and not torch.is_autocast_enabled(x.device.type)
            and not torch._C._is_torch_function_mode_enabled() and not torch._C._len_torch_dispatch_stack()
            and type(args[1]) in _PLAIN and type(args[2]) in _PLAIN and type(args[3]) in _PLAIN
            and type(args[4]) in _PLAIN and type(args[5]) in _PLAIN and type(args[6]) in _PLAIN)


def eager_mlp(x, w1, b1, w2, b2, activation):
    """``mlp`` for a caller that runs eagerly (``patch``): what the op computes, minus the dispatcher's host time
    where nothing needs it, and with the implementation chosen for calls made without CUDA graphs."""
    args = (x, w1, b1, None, None, w2, b2)
    if _plain_call(args):
        return _forward("mlp", *args, activation, eager=True)
    return torch.ops.mlp_fuser.mlp.default(x, w1, b1, w2, b2, activation)


def eager_gated_mlp(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation):
    """``gated_mlp`` for a caller that runs eagerly: see ``eager_mlp``."""
    args = (x, w_gate, b_gate, w_up, b_up, w_down, b_down)
    if _plain_call(args):
        return _forward("gated_mlp", *args, activation, eager=True)
    return torch.ops.mlp_fuser.gated_mlp.default(*args, activation)


EAGER = {torch.ops.mlp_fuser.mlp.default: eager_mlp, torch.ops.mlp_fuser.gated_mlp.default: eager_gated_mlp}


# ---- autograd: recompute the intermediate, never save it -----------------------------------------


def _backward_core(activation, need, dy, x, wg, bg, wu, bu, wd, bd):
    """Gradients of (x, wg, bg, wu, bu, wd, bd) (those ``need`` asks for) from dy; the intermediate is
    recomputed from x."""
    act = get_activation(activation)
    K, O = x.shape[-1], wd.shape[0]
    x2 = x.reshape(-1, K)
    dy2 = dy.reshape(-1, O)
    g = torch.nn.functional.linear(x2, wg, bg)
    a = act.fn(g)
    u = torch.nn.functional.linear(x2, wu, bu) if wu is not None else None
    h = a * u if u is not None else a
    dwd = dy2.t().mm(h) if need[5] else None
    dbd = dy2.sum(0) if bd is not None and need[6] else None
    dh = dy2.mm(wd)
    dg = dh * act.grad(g)
    du = None
    if u is not None:
        du = dh * a
        dg = dg * u
    dx = dg.mm(wg)
    if du is not None:
        dx = dx + du.mm(wu)
    dx = dx.view(x.shape) if need[0] else None
    dwg = dg.t().mm(x2) if need[1] else None
    dbg = dg.sum(0) if bg is not None and need[2] else None
    dwu = du.t().mm(x2) if du is not None and need[3] else None
    dbu = du.sum(0) if du is not None and bu is not None and need[4] else None
    return dx, dwg, dbg, dwu, dbu, dwd, dbd


class _MLPFunction(torch.autograd.Function):
    """Both ops under autograd: ``apply(keyset, op, *op_args)``; the forward runs the op below autograd."""

    @staticmethod
    def forward(ctx, keyset, op, *args):
        with torch._C._AutoDispatchBelowAutograd():
            y = op.redispatch(keyset & torch._C._after_autograd_keyset, *args)
        if y._is_view():  # a view of the 2-D result: returned as a tensor of its own, so callers may update it in
            y = y.detach()  # place under autograd (Falcon adds the attention output into the MLP output with +=)
        ctx.activation = args[-1]
        ctx.gated = len(args) == 8
        ctx.save_for_backward(*args[:-1])
        return y

    @staticmethod
    def backward(ctx, dy):
        need = ctx.needs_input_grad[2:]
        if ctx.gated:
            grads = _backward_core(ctx.activation, need, dy, *ctx.saved_tensors)
        else:
            x, w1, b1, w2, b2 = ctx.saved_tensors
            n = need
            need = (n[0], n[1], n[2], False, False, n[3], n[4])
            dx, dw1, db1, _, _, dw2, db2 = _backward_core(ctx.activation, need, dy, x, w1, b1, None, None, w2, b2)
            grads = (dx, dw1, db1, dw2, db2)
        return (None, None, *grads, None)


_DIRECT = frozenset({torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA})


def _register_autograd(op_name: str, forward) -> None:
    op = getattr(torch.ops.mlp_fuser, op_name).default

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return _MLPFunction.apply(keyset, op, *args)
        below = keyset & torch._C._after_autograd_keyset
        if below.highestPriorityTypeId() in _DIRECT:  # plain CPU/CUDA tensors: compute here, no second hop
            return forward(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(below, *args)

    _lib.impl(op_name, kernel, "Autograd", with_keyset=True)


_register_autograd("mlp", _mlp)
_register_autograd("gated_mlp", _gated_mlp)


# ---- autocast: like nn.Linear, cast floating inputs to the autocast dtype ------------------------


def _register_autocast(op_name: str, device_type: str) -> None:
    key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    key = getattr(torch._C.DispatchKey, key_name)
    op = getattr(torch.ops.mlp_fuser, op_name).default

    def kernel(_keyset, *args):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(a):
            if isinstance(a, Tensor) and a.is_floating_point() and a.device.type == device_type:
                return a.to(dtype)
            return a

        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*(cast(a) for a in args))

    _lib.impl(op_name, kernel, key_name, with_keyset=True)


for _op in ("mlp", "gated_mlp"):
    for _dev in ("cuda", "cpu"):
        _register_autocast(_op, _dev)
