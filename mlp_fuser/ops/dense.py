"""The op family ``mlp_fuser::mlp`` and ``mlp_fuser::gated_mlp``, registered through torch.library.

    mlp(x, w1, b1, w2, b2, activation, save_preact=False)    = act(x @ w1ᵀ + b1) @ w2ᵀ + b2
    gated_mlp(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, save_preact=False)
        = (act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up)) @ w_downᵀ + b_down

Weights are taken in the logical ``(out, in)`` shape of ``nn.Linear`` with any strides, so every storage
layout is a free view: GPT-2's ``Conv1D`` ``(in, out)`` weight is passed as ``w.t()``, a merged Phi-3
gate/up weight ``(2I, K)`` as ``w[:I]`` and ``w[I:]``. Nothing is copied or transposed per call.
``x`` has any number of leading dimensions; every bias is optional.

``save_preact`` only matters under autograd: False (the default) saves nothing of size (M, I) for the backward,
which recomputes the pre-activations g = x @ w_gateᵀ + b_gate and u = x @ w_upᵀ + b_up from x (two more GEMMs);
True computes the forward as cuBLAS g and u, one act·mul kernel and cuBLAS down, and keeps g and u (2·M·I
elements) for the backward. Either way the backward is ``mlp_backward`` (dh = dy @ w_down with the activation's
derivative in its epilogue, d(g) and d(u) packed in one (M, 2I) tensor), then one GEMM for d(w_gate | w_up), two
for dx and one for d(w_down).

Two helper ops of the family serve the training path, each a Triton kernel where the kernels run and aten
elsewhere: ``act_mul(g, u, activation)`` (h = act(g) * u) and ``mlp_backward(dy, w_down, g, u, activation,
need_h) -> (dgu, h)``. They have fake kernels, so torch.compile traces them; they have no autograd of their own.

Registered kernels, from the top of the dispatcher down:
- autocast (CUDA, CPU): casts the floating inputs to the autocast dtype, as ``nn.Linear`` does;
- autograd: with gradients needed, an autograd.Function (see ``save_preact``); without, a plain CPU or CUDA call
  is computed right there (the hop down the dispatcher would cost more host time than the kernels of a decode
  step), anything else (fake tensors, functionalization) goes on down;
- every device (CompositeExplicitAutograd): ``_forward``, which validates, then hands the call to ``dispatch.run``
  once (its choice for eager calls while ``calls.eager`` is set: the backend sets it around graphs run without CUDA
  graphs; on CUDA a call whose signature was seen before runs that call's launch plan, kept by the dispatcher);
- fake: shapes only, so torch.compile traces the op with no graph break.

Two entries skip the dispatcher where none of its layers is needed: ``eager_mlp`` / ``eager_gated_mlp`` (``patch``'s
fused forwards) and ``inductor_mlp`` / ``inductor_gated_mlp`` (what Inductor's generated code calls, as
``torch.ops.mlp_fuser._inductor_mlp`` / ``_inductor_gated_mlp``: ``mlp_fuser.runtime.inductor``).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import compat, config
from ..activations import ACTIVATIONS, ALIASES, get_activation
from ..dispatch import dense as dispatch
from ..dispatch.dense import MLPArgs
from ..dispatch.dense import new_args as _args
from ..kernels import act_mul as act_mul_kernel
from ..reference import reference_mlp_backward
from ..runtime import inductor, plans

_lib = torch.library.Library("mlp_fuser", "DEF")
_lib.define("mlp(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation, bool save_preact=False) "
            "-> Tensor")
_lib.define("gated_mlp(Tensor x, Tensor w_gate, Tensor? b_gate, Tensor w_up, Tensor? b_up, Tensor w_down, "
            "Tensor? b_down, str activation, bool save_preact=False) -> Tensor")
_lib.define("act_mul(Tensor g, Tensor? u, str activation) -> Tensor")
_lib.define("mlp_backward(Tensor dy, Tensor w_down, Tensor g, Tensor? u, str activation, bool need_h) "
            "-> (Tensor, Tensor)")

_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_KNOWN_ACTIVATIONS = frozenset(ACTIVATIONS) | frozenset(ALIASES)
_NAMES = {True: ("w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down"), False: ("w1", "b1", None, None, "w2", "b2")}


# ---- validation: each rule once, the message built only when it fails -----------------------------------


def _problem(a: MLPArgs) -> tuple[type[Exception], str] | None:
    """The first rule a call breaks, as (exception type, message), or None. Runs on every call."""
    x, wg, bg, wu, bu, wd, bd, activation = a
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
    for name, t, dims in zip(names, a[1:7], (2, 1, 2, 1, 2, 1)):
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


def check_args(op: str, a: MLPArgs) -> None:
    """Raise TypeError/ValueError naming the op, the argument and every shape when a call breaks a rule."""
    problem = _problem(a)
    if problem is not None:
        exc, msg = problem
        named = zip(("x", *_NAMES[a.wu is not None]), a)  # the seven tensors: zip stops before the activation
        shapes = ", ".join(f"{n}={_shape(t)}" for n, t in named if n is not None)
        raise exc(f"mlp_fuser::{op}: {msg} (shapes: {shapes})")


# ---- forward: every device ----------------------------------------------------------------------


def _forward(op: str, a: MLPArgs, eager: bool = False, key: tuple | None = None):
    """Validate, then hand the call to the dispatcher's one entry (``dispatch.run``: a launch plan for a signature
    seen before on CUDA, else its choice; ``eager``: its choice for calls made without CUDA graphs, where the host's
    time per call counts too). ``a``: the call's operands, x as given; ``key``: its signature where the caller has
    it."""
    if _problem(a) is not None:
        check_args(op, a)  # raises, naming the argument and every shape
    shape = a.x.shape
    M = shape[0] if len(shape) == 2 else math.prod(shape[:-1])  # not numel // K, which is 0 rows when K = 0
    if M == 0:
        return a.x.new_empty((*shape[:-1], a.wd.shape[0]))
    return dispatch.run(a, M, eager, key)


class _Calls(threading.local):
    """How this thread's registered-op calls run. ``eager``: without CUDA graphs (set by the backend around the
    graphs Inductor runs without them), so ``dispatch``'s choice for eager calls applies."""

    eager = False


calls = _Calls()


def _mlp(x, w1, b1, w2, b2, activation, save_preact=False):
    return _forward("mlp", _args((x, w1, b1, None, None, w2, b2, activation)), calls.eager)


def _gated_mlp(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, save_preact=False):
    return _forward("gated_mlp", _args((x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)), calls.eager)


_lib.impl("mlp", _mlp, "CompositeExplicitAutograd")
_lib.impl("gated_mlp", _gated_mlp, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::mlp")
def _mlp_fake(x, w1, b1, w2, b2, activation, save_preact=False):
    check_args("mlp", _args((x, w1, b1, None, None, w2, b2, activation)))
    inductor.install_if_inductor()  # the graph being traced may go to Inductor: its code then calls inductor_mlp
    return x.new_empty((*x.shape[:-1], w2.shape[0]))


@torch.library.register_fake("mlp_fuser::gated_mlp")
def _gated_mlp_fake(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, save_preact=False):
    check_args("gated_mlp", _args((x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)))
    inductor.install_if_inductor()
    return x.new_empty((*x.shape[:-1], w_down.shape[0]))


def mlp(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, activation: str,
        save_preact: bool = False) -> Tensor:
    """``act(x @ w1ᵀ + b1) @ w2ᵀ + b2``, weights in (out, in) shape: ``torch.ops.mlp_fuser.mlp``.
    ``save_preact``: keep x @ w1ᵀ + b1 for the backward instead of recomputing it."""
    return torch.ops.mlp_fuser.mlp.default(x, w1, b1, w2, b2, activation, save_preact)


def gated_mlp(x: Tensor, w_gate: Tensor, b_gate: Tensor | None, w_up: Tensor, b_up: Tensor | None, w_down: Tensor,
              b_down: Tensor | None, activation: str, save_preact: bool = False) -> Tensor:
    """``(act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up)) @ w_downᵀ + b_down``, weights in (out, in) shape:
    ``torch.ops.mlp_fuser.gated_mlp``. ``save_preact``: keep the gate and up outputs for the backward instead of
    recomputing them."""
    return torch.ops.mlp_fuser.gated_mlp.default(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation,
                                                 save_preact)


# ---- eager entry: the op without the dispatcher's hop, for calls that need none of its layers ---------
# (compat.plain_call: computing the call right here is exactly what the dispatcher would do)

_PLAIN = compat.PLAIN_TYPES


def eager_mlp(x, w1, b1, w2, b2, activation, save_preact=False):
    """``mlp`` for a caller that runs eagerly (``patch``): what the op computes, minus the dispatcher's host time
    where nothing needs it, and with the implementation chosen for calls made without CUDA graphs. Under autograd
    on plain tensors it applies the op's autograd.Function itself, as the op's autograd kernel would."""
    a = _args((x, w1, b1, None, None, w2, b2, activation))
    if compat.plain_operands(x, a[1:7]):
        if not (torch.is_grad_enabled() and compat.any_requires_grad(x, *a[1:7])):
            return _forward("mlp", a, True)
        return _MLPFunction.apply(None, torch.ops.mlp_fuser.mlp.default, save_preact, x, w1, b1, w2, b2, activation)
    return torch.ops.mlp_fuser.mlp.default(x, w1, b1, w2, b2, activation, save_preact)


def eager_gated_mlp(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, save_preact=False):
    """``gated_mlp`` for a caller that runs eagerly: see ``eager_mlp``."""
    a = _args((x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation))
    if compat.plain_operands(x, a[1:7]):
        if not (torch.is_grad_enabled() and compat.any_requires_grad(x, *a[1:7])):
            return _forward("gated_mlp", a, True)
        return _MLPFunction.apply(None, torch.ops.mlp_fuser.gated_mlp.default, save_preact,
                                  x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)
    return torch.ops.mlp_fuser.gated_mlp.default(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation,
                                                 save_preact)


EAGER = {torch.ops.mlp_fuser.mlp.default: eager_mlp, torch.ops.mlp_fuser.gated_mlp.default: eager_gated_mlp}


# ---- Inductor's entry: what a compiled graph's wrapper code calls (``mlp_fuser.runtime.inductor``) ----------------


def inductor_mlp(x, w1, b1, w2, b2, activation, save_preact=False):
    """``mlp`` as Inductor's generated code calls it: computed right here where nothing needs the dispatcher's
    layers, with the choice the registered op makes (``calls.eager``, set around graphs run without CUDA graphs);
    otherwise the registered op."""
    a = _args((x, w1, b1, None, None, w2, b2, activation))
    if compat.plain_call(x, a[1:7]):
        return _forward("mlp", a, calls.eager)
    return torch.ops.mlp_fuser.mlp.default(x, w1, b1, w2, b2, activation, save_preact)


def inductor_gated_mlp(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, save_preact=False):
    """``gated_mlp`` as Inductor's generated code calls it: see ``inductor_mlp``."""
    a = _args((x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation))
    if compat.plain_call(x, a[1:7]):
        return _forward("gated_mlp", a, calls.eager)
    return torch.ops.mlp_fuser.gated_mlp.default(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation,
                                                 save_preact)


# Generated code reaches what it calls from ``torch``; set here, where the ops are defined, so that code compiled in
# another process and loaded from Inductor's cache finds them in any process that has the ops.
INDUCTOR_NAMES = inductor.INDUCTOR_NAMES
compat.set_op_attribute(INDUCTOR_NAMES["mlp"], inductor_mlp)
compat.set_op_attribute(INDUCTOR_NAMES["gated_mlp"], inductor_gated_mlp)


# ---- the training path's helper ops: act_mul and mlp_backward ------------------------------------


def _act_mul(g, u, activation):
    if dispatch.triton_act_mul(g.device, g.dtype):
        return act_mul_kernel(g, u, activation)
    act = get_activation(activation)
    return act.fn(g) * u if u is not None else act.fn(g)


def _mlp_backward(dy, w_down, g, u, activation, need_h):
    M, I = g.shape
    args = (dy, w_down, g, u, activation, need_h)
    dgu, h = dispatch.resolve_backward(dy.device, dy.dtype, M, I, w_down.shape[0], u is not None, args).fn(*args)
    return dgu, h if h is not None else dy.new_empty(0)


_lib.impl("act_mul", _act_mul, "CompositeExplicitAutograd")
_lib.impl("mlp_backward", _mlp_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::act_mul")
def _act_mul_fake(g, u, activation):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


@torch.library.register_fake("mlp_fuser::mlp_backward")
def _mlp_backward_fake(dy, w_down, g, u, activation, need_h):
    M, I = g.shape
    return dy.new_empty((M, 2 * I if u is not None else I)), dy.new_empty((M, I) if need_h else (0,))


# ---- autograd: pre-activations recomputed (default) or saved; the fused backward ---------------------


def _forward_saving(op: str, a: MLPArgs):
    """The forward as cuBLAS gate and up, one act·mul, cuBLAS down: (y, g, u), g and u (M, I) for the backward."""
    check_args(op, a)
    x = a.x
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    g = F.linear(x2, a.wg, a.bg)
    u = F.linear(x2, a.wu, a.bu) if a.wu is not None else None
    if compat.plain_call(g, (u,)):
        h = _act_mul(g, u, a.activation)
    else:  # the op where a mode or a tracer must see it
        h = torch.ops.mlp_fuser.act_mul.default(g, u, a.activation)
    y = F.linear(h, a.wd, a.bd)
    return y.view(*x.shape[:-1], a.wd.shape[0]).detach(), g, u  # detach(): a tensor of its own, as _forward's


def _backward_core(need, dy, a: MLPArgs, g=None, u=None):
    """Gradients of the seven tensors of ``a`` (those ``need`` asks for) from dy; g and u, the pre-activations,
    are recomputed from x when not given."""
    x, wg, bg, wu, bu, wd, bd, activation = a
    K, O, I = x.shape[-1], wd.shape[0], wg.shape[0]
    x2 = x.reshape(-1, K)
    dy2 = dy.reshape(-1, O)
    if g is None or torch.is_grad_enabled():  # create_graph=True: saved g, u are not connected to x's graph
        g = F.linear(x2, wg, bg)
        u = F.linear(x2, wu, bu) if wu is not None else None
    if torch.is_grad_enabled():  # create_graph=True: aten ops, which autograd differentiates again
        dgu, h = reference_mlp_backward(dy2, wd, g, u, activation, need[5])
    elif compat.plain_call(dy2, (wd, g, u)):
        dgu, h = _mlp_backward(dy2, wd, g, u, activation, need[5])
    else:
        dgu, h = torch.ops.mlp_fuser.mlp_backward.default(dy2, wd, g, u, activation, need[5])
    del g, u  # recomputed ones are freed before the GEMMs below allocate
    dg, du = dgu[:, :I], (dgu[:, I:] if wu is not None else None)
    dwd = dy2.t().mm(h) if need[5] else None
    del h
    dbd = dy2.sum(0) if bd is not None and need[6] else None
    dx = None
    if need[0]:
        dx = dg.mm(wg) if du is None else torch.addmm(dg.mm(wg), du, wu)
        dx = dx.view(x.shape)
    dwg = dwu = dbg = dbu = None
    if du is not None and need[1] and need[3]:  # d(w_gate | w_up) in one GEMM over the packed gradient
        dwgu = dgu.t().mm(x2)
        dwg, dwu = dwgu[:I], dwgu[I:]
    else:
        dwg = dg.t().mm(x2) if need[1] else None
        dwu = du.t().mm(x2) if du is not None and need[3] else None
    if bg is not None and bu is not None and need[2] and need[4]:
        dbgu = dgu.sum(0)
        dbg, dbu = dbgu[:I], dbgu[I:]
    else:
        dbg = dg.sum(0) if bg is not None and need[2] else None
        dbu = du.sum(0) if du is not None and bu is not None and need[4] else None
    return dx, dwg, dbg, dwu, dbu, dwd, dbd


def _planned_saving(op: str, a: MLPArgs, key: tuple):
    """``_forward_saving`` through its plan for ``key``, recorded and kept on the signature's first call."""
    plan = dispatch.SAVING_PLANS.get(key)
    if plan is not None and not compat.launch_hooks():
        return plan(*a[:7])
    (y, g, u), launches = plans.recorded(_forward_saving, op, a)
    x = a.x
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    dispatch.keep_plan(dispatch.SAVING_PLANS, key, plans.build_saving(x, _args((x2, *a[1:])), launches))
    return y, g, u


def _planned_backward(key: tuple, need: tuple, dy: Tensor, a: MLPArgs, g=None, u=None):
    """``_backward_core`` through its plan for ``key``, recorded and kept on the signature's first call."""
    plan = dispatch.BACKWARD_PLANS.get(key)
    if plan is not None and not compat.launch_hooks():
        return plan(dy, *a[:7], g, u)
    grads, launches = plans.recorded(_backward_core, need, dy, a, g, u)
    dispatch.keep_plan(dispatch.BACKWARD_PLANS, key, plans.build_backward(need, dy, a, g, u, launches))
    return grads


class _MLPFunction(torch.autograd.Function):
    """Both ops under autograd: ``apply(keyset, op, save_preact, *op_args)``, op_args without save_preact; keyset
    None from the eager entries (plain tensors: the forward is computed right here). There, on CUDA, the forward and
    the backward run launch plans (``plans``) for signatures seen before."""

    @staticmethod
    def forward(ctx, keyset, op, save_preact, *args):
        ctx.activation = args[-1]
        ctx.gated = len(args) == 8
        name = "gated_mlp" if ctx.gated else "mlp"
        a = _args(args if ctx.gated else (*args[:3], None, None, *args[3:]))
        key = None
        if keyset is None and dispatch.plans_apply(a.x):
            key = dispatch.signature(a, "save" if save_preact else True)
        ctx.plan_key = key
        if save_preact:
            y, g, u = _forward_saving(name, a) if key is None else _planned_saving(name, a, key)
            ctx.save_for_backward(*a[:7], g, u)
        elif keyset is None:
            y = _forward(name, a, True, key)
            ctx.save_for_backward(*a[:7])
        else:
            with compat.below_autograd():
                y = op.redispatch(keyset & compat.AFTER_AUTOGRAD, *args)
            ctx.save_for_backward(*a[:7])
        # A view of the 2-D result is returned as a tensor of its own, so callers may update it in place under
        # autograd (Falcon adds the attention output into the MLP output with +=).
        return y.detach() if compat.view_base(y) is not None else y

    @staticmethod
    def backward(ctx, dy):
        n = ctx.needs_input_grad[3:]
        need = n[:7] if ctx.gated else (n[0], n[1], n[2], False, False, n[3], n[4])
        saved = ctx.saved_tensors
        a = _args((*saved[:7], ctx.activation))
        key = ctx.plan_key
        if key is not None and not torch.is_grad_enabled() and compat.plain_call(dy, ()):
            # the backward's signature: the forward's, the gradients asked for, dy's metadata, the choice's setting
            bkey = (key, need, dy.shape, dy.stride(), dy.dtype, dy.device, dy.data_ptr() & 15, config.triton_backward)
            grads = _planned_backward(bkey, need, dy, a, *saved[7:])
        else:
            grads = _backward_core(need, dy, a, *saved[7:])
        if not ctx.gated:
            grads = grads[:3] + grads[5:]
        return (None, None, None, *grads, None)


_DIRECT = compat.PLAIN_KEYS
_AFTER_AUTOGRAD = compat.AFTER_AUTOGRAD
_direct_by_keyset: dict[int, bool] = {}  # a call's key set (raw) -> whether below autograd it is plain CPU/CUDA


def _register_autograd(op_name: str, forward, n_args: int) -> None:
    op = getattr(torch.ops.mlp_fuser, op_name).default

    def kernel(keyset, *args):
        # The dispatcher hands Python kernels the arguments as given: save_preact is there only when passed.
        if torch.is_grad_enabled() and compat.any_requires_grad(*args):
            save = len(args) > n_args and args[n_args]
            return _MLPFunction.apply(keyset, op, save, *args[:n_args])
        raw = keyset.raw_repr()  # an int: the answer below is kept per key set (a few per process)
        direct = _direct_by_keyset.get(raw)
        if direct is None:
            direct = _direct_by_keyset[raw] = (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in _DIRECT
        if direct and compat.PRIVATE:  # plain CPU/CUDA tensors: compute here, no second hop
            return forward(*args)
        with compat.below_autograd():
            return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)

    _lib.impl(op_name, kernel, "Autograd", with_keyset=True)


_register_autograd("mlp", _mlp, 6)
_register_autograd("gated_mlp", _gated_mlp, 8)


# ---- autocast: like nn.Linear, cast floating inputs to the autocast dtype ------------------------


def _register_autocast(op_name: str, device_type: str) -> None:
    key_name = compat.autocast_key(device_type)
    op = getattr(torch.ops.mlp_fuser, op_name).default

    def kernel(_keyset, *args):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(a):
            if isinstance(a, Tensor) and a.is_floating_point() and a.device.type == device_type:
                return a.to(dtype)
            return a

        with compat.excluding(key_name):
            return op(*(cast(a) for a in args))

    _lib.impl(op_name, kernel, key_name, with_keyset=True)


for _op in ("mlp", "gated_mlp"):
    for _dev in ("cuda", "cpu"):
        _register_autocast(_op, _dev)
