"""The op family ``mlp_fuser::mlp`` and ``mlp_fuser::gated_mlp``, registered through torch.library.

    mlp(x, w1, b1, w2, b2, activation)                       = act(x @ w1ᵀ + b1) @ w2ᵀ + b2
    gated_mlp(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)
        = (act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up)) @ w_downᵀ + b_down

Weights are taken in the logical ``(out, in)`` shape of ``nn.Linear`` with any strides, so every storage
layout is a free view: GPT-2's ``Conv1D`` ``(in, out)`` weight is passed as ``w.t()``, a merged Phi-3
gate/up weight ``(2I, K)`` as ``w[:I]`` and ``w[I:]``. Nothing is copied or transposed per call.
``x`` has any number of leading dimensions; every bias is optional.

Around the compute: a fake implementation (so torch.compile traces the op with no graph break),
autograd that recomputes the intermediate instead of saving it, and autocast that behaves like
``nn.Linear`` does. The compute itself is chosen in ``dispatch.py``.
"""

import math
from typing import Optional

import torch
from torch import Tensor

from . import dispatch
from .activations import ACTIVATIONS, ALIASES, get_activation

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KNOWN_ACTIVATIONS = frozenset(ACTIVATIONS) | frozenset(ALIASES)


def _shape(t: Optional[Tensor]) -> str:
    return "None" if t is None else f"({', '.join(str(s) for s in t.shape)})"


def check_args(op: str, x, wg, bg, wu, bu, wd, bd, activation) -> dispatch.Problem:
    """Validate one call and describe it; bad input raises TypeError/ValueError naming the op, the argument
    and the shapes. This runs on every call, so the common case is a handful of comparisons."""
    try:
        dt, dev, K = x.dtype, x.device, x.shape[-1]
        I, O = wg.shape[0], wd.shape[0]  # noqa: E741
        ok = (
            dt in _FLOAT_DTYPES and activation in _KNOWN_ACTIVATIONS and wg.dim() == 2 and wd.dim() == 2
            and wg.shape[1] == K and wd.shape[1] == I
            and all(t.dtype == dt and t.device == dev for t in (wg, wd, bg, wu, bu, bd) if t is not None)
            and (wu is None or wu.shape == wg.shape)
            and all(b is None or (b.dim() == 1 and b.shape[0] == n) for b, n in ((bg, I), (bu, I), (bd, O)))
        )
    except (AttributeError, IndexError, TypeError):
        ok = False
    if not ok:
        _diagnose(op, x, wg, bg, wu, bu, wd, bd, activation)  # raises, naming what is wrong
    M = math.prod(x.shape[:-1])  # not numel // K, which is 0 rows when K = 0
    return dispatch.Problem(dev.type, dt, M, K, I, O, wu is not None)


def _diagnose(op: str, x, wg, bg, wu, bu, wd, bd, activation) -> None:
    """Find what is wrong with a call that failed check_args' quick test, and raise about it."""
    if wu is None:
        names = ("w1", "b1", None, None, "w2", "b2")
    else:
        names = ("w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down")
    tensors = dict(zip(names, (wg, bg, wu, bu, wd, bd)))
    tensors.pop(None, None)

    def fail(exc, msg):  # the message is built only when something is wrong: this runs on every call
        shapes = ", ".join(f"{n}={_shape(t)}" for n, t in {"x": x, **tensors}.items())
        raise exc(f"mlp_fuser::{op}: {msg} (shapes: {shapes})")

    try:
        get_activation(activation)
    except (TypeError, ValueError) as e:
        fail(type(e), f"argument 'activation': {str(e).removeprefix('mlp_fuser: ')}")
    if not isinstance(x, Tensor):
        fail(TypeError, f"x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        fail(TypeError, f"x has dtype {x.dtype}; expected one of float16, bfloat16, float32, float64")
    if x.dim() < 1:
        fail(ValueError, "x must have at least one dimension (its last is K)")
    for n, t in tensors.items():
        if t is None:
            if n.startswith("w"):
                fail(TypeError, f"{n} is required")
            continue
        if not isinstance(t, Tensor):
            fail(TypeError, f"{n} must be a Tensor or None, got {type(t).__name__}")
        if t.dtype != x.dtype:
            fail(TypeError, f"{n} has dtype {t.dtype} but x has dtype {x.dtype}")
        if t.device != x.device:
            fail(ValueError, f"{n} is on {t.device} but x is on {x.device}")
        want_dim = 2 if n.startswith("w") else 1
        if t.dim() != want_dim:
            fail(ValueError, f"{n} must have {want_dim} dimension(s), got {t.dim()}")
    K = x.shape[-1]
    I, O = wg.shape[0], wd.shape[0]  # noqa: E741
    w_first, w_last = names[0], names[4]
    if wg.shape[1] != K:
        fail(ValueError, f"{w_first} has {wg.shape[1]} input features but x has {K} (its last dimension)")
    if wu is not None and tuple(wu.shape) != tuple(wg.shape):
        fail(ValueError, f"w_up must have the shape of w_gate, {_shape(wg)}")
    if wd.shape[1] != I:
        fail(ValueError, f"{w_last} has {wd.shape[1]} input features but the intermediate size is {I}")
    for n, b, size in ((names[1], bg, I), ("b_up", bu, I), (names[5], bd, O)):
        if b is not None and b.shape[0] != size:
            fail(ValueError, f"{n} has {b.shape[0]} elements; expected {size}")
    fail(ValueError, "invalid arguments")  # unreachable when the checks above mirror check_args


def _forward(op, x, wg, bg, wu, bu, wd, bd, activation):
    p = check_args(op, x, wg, bg, wu, bu, wd, bd, activation)
    out_shape = (*x.shape[:-1], p.O)
    if p.M == 0:
        return x.new_empty(out_shape)
    x2 = x.reshape(p.M, p.K)
    args = (x2, wg, bg, wu, bu, wd, bd, activation)
    impl = dispatch.select(p, args)
    # detach(): the 2-D result reshaped, as a tensor of its own rather than a view, so callers may update it in
    # place under autograd (Falcon adds the attention output into the MLP output with +=).
    return impl.fn(*args).view(out_shape).detach()


def _fake(op, x, wg, bg, wu, bu, wd, bd, activation):
    check_args(op, x, wg, bg, wu, bu, wd, bd, activation)
    return x.new_empty((*x.shape[:-1], wd.shape[0]))


# ---- the ops ----------------------------------------------------------------------------------


@torch.library.custom_op("mlp_fuser::mlp", mutates_args=())
def mlp(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str) -> Tensor:
    """``act(x @ w1ᵀ + b1) @ w2ᵀ + b2``, weights in (out, in) shape."""
    return _forward("mlp", x, w1, b1, None, None, w2, b2, activation)


@mlp.register_fake
def _mlp_fake(x, w1, b1, w2, b2, activation):
    return _fake("mlp", x, w1, b1, None, None, w2, b2, activation)


@torch.library.custom_op("mlp_fuser::gated_mlp", mutates_args=())
def gated_mlp(
    x: Tensor,
    w_gate: Tensor,
    b_gate: Optional[Tensor],
    w_up: Tensor,
    b_up: Optional[Tensor],
    w_down: Tensor,
    b_down: Optional[Tensor],
    activation: str,
) -> Tensor:
    """``(act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up)) @ w_downᵀ + b_down``, weights in (out, in) shape."""
    return _forward("gated_mlp", x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)


@gated_mlp.register_fake
def _gated_mlp_fake(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation):
    return _fake("gated_mlp", x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)


# ---- autograd: recompute the intermediate, never save it -----------------------------------------


def _backward_core(ctx, dy, x, wg, bg, wu, bu, wd, bd):
    """Gradients of (x, wg, bg, wu, bu, wd, bd) from dy; the intermediate is recomputed from x."""
    act = get_activation(ctx.activation)
    K, O = x.shape[-1], wd.shape[0]
    x2 = x.reshape(-1, K)
    dy2 = dy.reshape(-1, O)
    g = torch.nn.functional.linear(x2, wg, bg)
    a = act.fn(g)
    u = torch.nn.functional.linear(x2, wu, bu) if wu is not None else None
    h = a * u if u is not None else a
    need = ctx.needs_input_grad
    i_wd, i_bd = (5, 6) if wu is not None else (3, 4)
    dwd = dy2.t().mm(h) if need[i_wd] else None
    dbd = dy2.sum(0) if bd is not None and need[i_bd] else None
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
    if u is None:
        return dx, dwg, dbg, dwd, dbd
    dwu = du.t().mm(x2) if need[3] else None
    dbu = du.sum(0) if bu is not None and need[4] else None
    return dx, dwg, dbg, dwu, dbu, dwd, dbd


def _setup_context(ctx, inputs, output):
    *tensors, activation = inputs
    ctx.activation = activation
    ctx.save_for_backward(*tensors)


def _mlp_backward(ctx, dy):
    x, w1, b1, w2, b2 = ctx.saved_tensors
    return (*_backward_core(ctx, dy, x, w1, b1, None, None, w2, b2), None)


def _gated_mlp_backward(ctx, dy):
    return (*_backward_core(ctx, dy, *ctx.saved_tensors), None)


torch.library.register_autograd("mlp_fuser::mlp", _mlp_backward, setup_context=_setup_context)
torch.library.register_autograd("mlp_fuser::gated_mlp", _gated_mlp_backward, setup_context=_setup_context)


# ---- autocast: like nn.Linear, cast floating inputs to the autocast dtype ------------------------

_lib = torch.library.Library("mlp_fuser", "FRAGMENT")


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
