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
from torch import Tensor

from .. import compat
from ..activations import ACTIVATIONS, ALIASES, get_activation
from ..dispatch import dense as dispatch
from ..dispatch import dense_training as training
from ..dispatch.dense import MLPArgs
from ..dispatch.dense import new_args as _args
from ..runtime import inductor

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


def _rows(op: str, a: MLPArgs) -> int:
    """Validate the call ``a`` (x as given), then its number of rows M."""
    if _problem(a) is not None:
        check_args(op, a)  # raises, naming the argument and every shape
    shape = a.x.shape
    return shape[0] if len(shape) == 2 else math.prod(shape[:-1])  # not numel // K, which is 0 rows when K = 0


def _forward(op: str, a: MLPArgs, eager: bool = False, key: tuple | None = None):
    """Validate, then hand the call to the dispatcher's one entry (``dispatch.run``: a launch plan for a signature
    seen before on CUDA, else its choice; ``eager``: its choice for calls made without CUDA graphs, where the host's
    time per call counts too). ``a``: the call's operands, x as given; ``key``: its signature where the caller has
    it."""
    return dispatch.run(a, _rows(op, a), eager, key)


def _forward_training(op: str, a: MLPArgs, save: bool, planned: bool):
    """The forward under autograd: validate, then hand the call to the training path's one entry
    (``dense_training.forward``): (y, g, u, the signature the backward's plan builds on)."""
    return training.forward(a, _rows(op, a), save, planned)


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


# ---- the training path's helper ops: act_mul and mlp_backward (their kernels: dispatch/dense_training.py) --------


_lib.impl("act_mul", training.act_mul, "CompositeExplicitAutograd")
_lib.impl("mlp_backward", training.mlp_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::act_mul")
def _act_mul_fake(g, u, activation):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


@torch.library.register_fake("mlp_fuser::mlp_backward")
def _mlp_backward_fake(dy, w_down, g, u, activation, need_h):
    M, I = g.shape
    return dy.new_empty((M, 2 * I if u is not None else I)), dy.new_empty((M, I) if need_h else (0,))


# ---- autograd: pre-activations recomputed (default) or saved; the fused backward ---------------------


class _MLPFunction(torch.autograd.Function):
    """Both ops under autograd: ``apply(keyset, op, save_preact, *op_args)``, op_args without save_preact; keyset
    None from the eager entries (plain tensors: the forward is computed right here). There, on CUDA, the forward and
    the backward run launch plans for signatures seen before (``dense_training``, which computes both halves)."""

    @staticmethod
    def forward(ctx, keyset, op, save_preact, *args):
        ctx.activation = args[-1]
        ctx.gated = len(args) == 8
        name = "gated_mlp" if ctx.gated else "mlp"
        a = _args(args if ctx.gated else (*args[:3], None, None, *args[3:]))
        if save_preact or keyset is None:
            y, g, u, ctx.plan_key = _forward_training(name, a, save_preact, keyset is None)
            ctx.save_for_backward(*a[:7], g, u)
        else:
            ctx.plan_key = None
            with compat.below_autograd():
                y = op.redispatch(keyset & compat.AFTER_AUTOGRAD, *args)
            ctx.save_for_backward(*a[:7], None, None)  # no pre-activations: the backward recomputes them
        # A view of the 2-D result is returned as a tensor of its own, so callers may update it in place under
        # autograd (Falcon adds the attention output into the MLP output with +=).
        return y.detach() if compat.view_base(y) is not None else y

    @staticmethod
    def backward(ctx, dy):
        n = ctx.needs_input_grad[3:]
        need = n[:7] if ctx.gated else (n[0], n[1], n[2], False, False, n[3], n[4])
        saved = ctx.saved_tensors
        grads = training.backward(need, dy, _args((*saved[:7], ctx.activation)), saved[7], saved[8], ctx.plan_key)
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
