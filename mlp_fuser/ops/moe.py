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

    moe_mlp_save(same arguments) -> (y, gu)
y as above and gu = x[t] @ w_gate_up[e]ᵀ + b_gate_up[e] per pair (row t·k + j, w_gate_up's row layout, x's dtype;
g and u rounded to it before A, so that y and the gradients use the values kept; rows of dropped pairs unwritten):
the training forward of backward "save", whose backward reads gu instead of recomputing that GEMM. Where the Triton
backward cannot run (``saves_preact``) gu is (0, N) and the op computes moe_mlp. The entries take ``save_preact``
and call it only where a gradient is recorded, so inference never stores gu.

Kernels, top of the dispatcher down: autocast (like nn.Linear: floating inputs cast to the autocast dtype);
autograd (``torch.library.register_autograd``: the inputs saved, and moe_mlp_save's gu; the backward is the op
``mlp_fuser::moe_mlp_backward``, in eager mode and in compiled graphs alike, whose kernel runs what the dispatcher's
table of backwards, ``experts.BACKWARD``, chooses: the Triton backward (weight gradients by its kernel or by
grouped_mm) or autograd through the aten path recomputed from the inputs; with create_graph=True the aten path,
differentiable again); every device: ``_forward`` runs what the dispatcher chose among the experts' rows
(``dispatch/experts.py``: the Triton paths on CUDA, timed once per shape bucket, for plain calls and for CUDA-graph
captures apart; the aten path elsewhere; a call whose signature, ``_signature``, was seen runs what the first one
derived, skipping validation and the choice); fake: shapes only.
``eager_moe_mlp`` is the entry for eager callers: plain calls skip those layers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import compat, config
from ..activations import get_activation
from ..dispatch import core, experts
from ..dispatch.experts import FLOAT as _FLOAT
from ..dispatch.experts import Problem
from ..dispatch.experts import expert_act as _expert_act  # noqa: F401  (quant_moe's name for it)
from ..kernels import moe as kmoe
from ..reference import Gate, gates  # noqa: F401  (the op's activations, as patch and patterns name them)
from ..reference import reference_experts as reference
from ..runtime import inductor

_lib = torch.library.Library("mlp_fuser", "FRAGMENT")
_lib.define(
    "moe_mlp(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor? b_gate_up, Tensor w_down, "
    "Tensor? b_down, str activation, bool interleaved=False, float? limit=None, bool clamp_after=False, "
    "float up_offset=0.0) -> Tensor")
_lib.define(
    "moe_mlp_save(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor? b_gate_up, Tensor w_down, "
    "Tensor? b_down, str activation, bool interleaved=False, float? limit=None, bool clamp_after=False, "
    "float up_offset=0.0) -> (Tensor, Tensor)")

_INT = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
# Checking ids for negative values reads them on the host: on CUDA only where asked (a sync per call otherwise).


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


def reset() -> None:
    """Forget the experts' choices and the calls' signatures."""
    core.reset(experts.EXPERTS)
    core.reset(experts.BACKWARD)
    _EAGER.clear()
    _SAVING.clear()


# ---- the op's kernels ------------------------------------------------------------------------------------------


def _gate(w_gate_up: Tensor, w_down: Tensor, activation, interleaved, limit, clamp_after, up_offset) -> Gate:
    return Gate(get_activation(activation).name, w_gate_up.shape[1] == 2 * w_down.shape[2], bool(interleaved),
                None if limit is None else float(limit), bool(clamp_after), float(up_offset))


_EAGER: dict[tuple, tuple] = {}  # _signature -> (plain runner, graph runner, on CUDA, check ids, flatten, T, k, H)
_MAX_EAGER = 4096  # a process that sees endless new shapes starts afresh rather than growing the dict


def _signature(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset) -> tuple:
    """The key of a call: everything ``_problem`` checks and the choice keys on, and what the kernels' integer
    arguments are built from: each tensor's shape, strides, dtype and device, the activation and its options, the
    settings. Equal signatures: the full path would accept both calls and run the same kernels with the same integers
    (the data pointers' alignment, which Triton also specialises on, is the launches' own key)."""
    return (activation, interleaved, limit, clamp_after, up_offset, config.force_impl, config.autotune,
            config.moe_tma, config.moe_rows_lowp, config.triton_on_cpu,
            x.dtype is torch.float32 and torch.backends.cuda.matmul.allow_tf32,
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
    y = experts.choose(p, args).fn(*args)
    choice = experts.cached(p)
    if key is not None and choice is not None:  # none while a capture ran the aten path before any choice
        plain = experts.runner(choice.eager, args)
        graph = plain if choice.graph is choice.eager else experts.runner(choice.graph, args)
        if len(_EAGER) >= _MAX_EAGER:
            _EAGER.clear()
        _EAGER[key] = (plain, graph, x.is_cuda, not x.is_cuda and ids.numel() > 0, x.dim() != 2 or ids.dim() != 2,
                       T, k, H)
    return y.view(*x.shape[:-1], H)


def _own_tensor(forward):
    """``forward`` as the dispatcher's kernel: a view of the result returned as a tensor of its own, so callers may
    update it in place under autograd (a custom autograd Function's view output may not be)."""
    def kernel(*args):
        y = forward(*args)
        return y if compat.view_base(y) is None else y.detach()
    return kernel


_kernel = _own_tensor(_forward)
_lib.impl("moe_mlp", _kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::moe_mlp")
def _fake(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved=False, limit=None, clamp_after=False, up_offset=0.0):
    check_args(x, ids, wts, wgu, bgu, wd, bd, activation)
    inductor.install_if_inductor()  # the graph being traced may go to Inductor: its code then calls our entry
    return x.new_empty(x.shape)


# ---- backward "save": moe_mlp_save keeps gate/up's output --------------------------------------------------


def saves_preact(device: torch.device, dtype: torch.dtype, activation: str) -> bool:
    """Whether ``moe_mlp_save`` keeps gu for calls on ``device`` in ``dtype``: where the Triton backward runs (CUDA,
    or the CPU with ``config.triton_on_cpu``; float16, bfloat16, float32; an activation with a Triton derivative)
    and no aten row is forced (``config.force_impl``). Its fake kernel reads the same, so no shape decides it."""
    return ((device.type == "cuda" or (device.type == "cpu" and config.triton_on_cpu))
            and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and get_activation(activation).triton_grad is not None and config.force_impl not in ("grouped_mm",
                                                                                                  "reference"))


_SAVING: dict[tuple, tuple] = {}  # _signature -> (plan returning (y, gu), check ids, flatten, T, k, H)


def _forward_save(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved=False, limit=None, clamp_after=False,
                  up_offset=0.0):
    """``moe_mlp_save`` on real tensors: a signature seen before runs the launch plan the first call made (as
    ``_forward``), else ``_forward_save_full``."""
    try:
        key = _signature(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset)
        hit = _SAVING.get(key)
    except TypeError:
        key = hit = None
    if hit is None:
        return _forward_save_full(key, x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after,
                                  up_offset)
    plan, check, flat, T, k, H = hit
    if check or config.check_routing:
        _check_ids(ids)
    if not flat:
        return plan(x, ids, wts, wgu, bgu, wd, bd)
    y, gu = plan(x.reshape(T, H), ids.reshape(T, k), wts.reshape(T, k), wgu, bgu, wd, bd)
    return y.view(x.shape), gu


def _forward_save_full(key, x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset):
    """The Triton grouped path the dispatcher would take (sorted, or sorted_fused where that is its choice), its
    gate/up kernel keeping gu, as a launch plan kept for the signature; where ``saves_preact`` says no, moe_mlp's y
    and an empty gu."""
    if not saves_preact(x.device, x.dtype, activation):
        return (_kernel(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset),
                x.new_empty((0, wgu.shape[1])))
    check_args(x, ids, wts, wgu, bgu, wd, bd, activation)
    _check_ids(ids)
    H, k, E, I = x.shape[-1], ids.shape[-1], wgu.shape[0], wd.shape[2]
    T = math.prod(x.shape[:-1])
    if T == 0:
        return x.new_zeros(x.shape), x.new_empty((0, wgu.shape[1]))
    x2, ids2, wts2 = x.reshape(T, H), ids.reshape(T, k), wts.reshape(T, k)
    gate = _gate(wgu, wd, activation, interleaved, limit, clamp_after, up_offset)
    if k == 0 or E == 0 or H == 0 or I == 0:  # nothing to plan
        gu = x.new_empty((T * k, wgu.shape[1]))
        y = kmoe.moe_experts(x2, ids2, wts2, wgu, bgu, wd, bd, experts.expert_act(gate), gate.interleaved, gu=gu)
        return y.view(x.shape), gu
    p = Problem(x.device.type, x.dtype, T, k, E, H, I, gate, bgu is not None or bd is not None)
    args = (x2, ids2, wts2, wgu, bgu, wd, bd, gate)
    path = {"triton_moe_sorted_fused": "sorted_fused", "triton_moe_sorted_tma": "sorted_tma"}.get(
        experts.choose(p, args).name, "sorted")
    plan = kmoe.experts_plan(*args[:-1], experts.expert_act(gate), gate.interleaved, path, save_gu=True)
    if key is not None:
        if len(_SAVING) >= _MAX_EAGER:
            _SAVING.clear()
        _SAVING[key] = (plan, not x.is_cuda, x.dim() != 2 or ids.dim() != 2, T, k, H)
    y, gu = plan(*args[:-1])
    return y.view(x.shape), gu


def _save_kernel(*args):
    y, gu = _forward_save(*args)
    return y if compat.view_base(y) is None else y.detach(), gu  # as ``_own_tensor``


_lib.impl("moe_mlp_save", _save_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::moe_mlp_save")
def _save_fake(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved=False, limit=None, clamp_after=False,
               up_offset=0.0):
    check_args(x, ids, wts, wgu, bgu, wd, bd, activation)
    rows = math.prod(ids.shape) if saves_preact(x.device, x.dtype, activation) else 0
    return x.new_empty(x.shape), x.new_empty((rows, wgu.shape[1]))


_lib.define(
    "moe_mlp_backward(Tensor dy, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor? b_gate_up, "
    "Tensor w_down, Tensor? b_down, str activation, bool interleaved, float? limit, bool clamp_after, float up_offset, "
    "bool need_dx, bool need_weights, Tensor? gu=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _backward(dy, x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset, need_dx,
              need_weights, gu=None):
    """The op's backward on real tensors: what the dispatcher's table (``experts.BACKWARD``) chooses, the Triton
    backward (reading ``gu``, moe_mlp_save's, where it is not empty) or autograd through the aten path recomputed
    from the inputs."""
    H, k = x.shape[-1], ids.shape[-1]
    T = math.prod(x.shape[:-1])
    gate = _gate(wgu, wd, activation, interleaved, limit, clamp_after, up_offset)
    args = (x.reshape(T, H), ids.reshape(T, k), wts.reshape(T, k), wgu, bgu, wd, bd, gate)
    if T == 0:
        grads = (x.new_zeros((0, H)), wts.new_zeros((0, k)), *(torch.zeros_like(t) if t is not None else None
                                                               for t in (wgu, bgu, wd, bd)))
    else:
        gu = gu if gu is not None and gu.numel() else None
        p = experts.problem(*args[:2], wgu, wd, bgu, bd, gate, need_dx, need_weights, gu is not None)
        grads = experts.choose_backward(p, args, gu).fn(*args, dy.reshape(T, H), (need_dx, need_weights, gu))
    dx, dwts, *dw = grads
    wanted = (need_dx, True, need_weights, need_weights, need_weights, need_weights)
    # the fake kernel's outputs: dx, dwts contiguous; each weight's gradient in the weight's own layout (GPT-OSS's
    # transposed views: AccumulateGrad then keeps it as the parameter's grad, no clone); (0,) where not asked
    return (*(g.reshape(t.shape).contiguous() if w else x.new_empty(0)
              for g, t, w in zip((dx, dwts), (x, wts), wanted)),
            *(_in_layout(g, t) if w and t is not None else x.new_empty(0)
              for g, t, w in zip(dw, (wgu, bgu, wd, bd), wanted[2:])))


def _layout(t: Tensor) -> tuple[int, ...]:
    """The strides ``empty_like(t)`` gives: t's own where t is dense, else contiguous (no memory allocated)."""
    return torch.empty_like(t, device="meta").stride()


def _in_layout(g: Tensor, t: Tensor) -> Tensor:
    """g in t's shape and ``_layout(t)``: as it is where a row computed it so, else one copy."""
    g = g.reshape(t.shape)
    want = _layout(t)
    return g if g.stride() == want else torch.empty_strided(t.shape, want, dtype=g.dtype, device=g.device).copy_(g)


_lib.impl("moe_mlp_backward", _backward, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::moe_mlp_backward")
def _backward_fake(dy, x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset, need_dx,
                   need_weights, gu=None):
    wanted = (need_dx, True, need_weights, need_weights, need_weights, need_weights)
    return (*(t.new_empty(t.shape) if w else x.new_empty(0) for t, w in zip((x, wts), wanted)),
            *(torch.empty_like(t) if w and t is not None else x.new_empty(0)  # _layout(t)'s strides
              for t, w in zip((wgu, bgu, wd, bd), wanted[2:])))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])  # the inputs alone: the backward recomputes gate/up from x
    ctx.options = inputs[7:]


def _setup_context_save(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7], output[1])  # and gate/up's output, which the backward reads
    ctx.options = inputs[7:]
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero gradient of gu's size made for the backward


def _differentiable_backward(ctx, dy):
    """create_graph=True: every gradient through the aten path, which autograd differentiates again."""
    x, ids, wts, wgu, bgu, wd, bd = ctx.saved_tensors[:7]
    H, k = x.shape[-1], ids.shape[-1]
    T = math.prod(x.shape[:-1])
    gate = _gate(wgu, wd, *ctx.options)
    inputs = [(i, t) for i, t in enumerate((x, None, wts, wgu, bgu, wd, bd)) if ctx.needs_input_grad[i]]
    y = reference(x.reshape(T, H), ids.reshape(T, k), wts.reshape(T, k), wgu, bgu, wd, bd, gate)
    got = torch.autograd.grad(y, [t for _, t in inputs], dy.reshape(T, H), create_graph=True)
    grads = [None] * 12
    for (i, _), g in zip(inputs, got):
        grads[i] = g
    return tuple(grads)


def _autograd_backward(ctx, dy, *_):
    """Both forward ops' backward: ``moe_mlp_backward`` (with moe_mlp_save's gu), in eager mode as in a compiled
    graph."""
    if dy is None:  # moe_mlp_save's y unused (its gradients are not materialized)
        return (None,) * 12
    if torch.is_grad_enabled():
        return _differentiable_backward(ctx, dy)
    saved = ctx.saved_tensors
    gu = saved[7] if len(saved) > 7 else None
    need = ctx.needs_input_grad
    need_dx, need_weights = need[0], any(need[3:7])
    if compat.plain_call(dy, saved[:1] + saved[2:]):
        grads = _backward(dy, *saved[:7], *ctx.options, need_dx, need_weights, gu)
    else:  # the op where a mode or a tracer must see it
        grads = torch.ops.mlp_fuser.moe_mlp_backward.default(dy, *saved[:7], *ctx.options, need_dx, need_weights, gu)
    dx, dwts, dwgu, dbgu, dwd, dbd = grads
    return (dx if need[0] else None, None, dwts if need[2] else None, dwgu if need[3] else None,
            dbgu if need[4] else None, dwd if need[5] else None, dbd if need[6] else None, *(None,) * 5)


torch.library.register_autograd("mlp_fuser::moe_mlp", _autograd_backward, setup_context=_setup_context, lib=_lib)
torch.library.register_autograd("mlp_fuser::moe_mlp_save", _autograd_backward, setup_context=_setup_context_save,
                                lib=_lib)


def _register_autocast(device_type: str, name: str) -> None:
    key_name = compat.autocast_key(device_type)
    op = getattr(torch.ops.mlp_fuser, name).default

    def kernel(_keyset, x, ids, wts, wgu, bgu, wd, bd, *rest):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(a):
            return a.to(dtype) if a is not None and a.is_floating_point() and a.device.type == device_type else a

        with compat.excluding(key_name):
            return op(cast(x), ids, wts, cast(wgu), cast(bgu), cast(wd), cast(bd), *rest)

    _lib.impl(name, kernel, key_name, with_keyset=True)


for _dev in ("cuda", "cpu"):
    for _name in ("moe_mlp", "moe_mlp_save"):
        _register_autocast(_dev, _name)


def _functorch(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset) -> Tensor:
    """Under a torch.func transform: the aten path, which the transforms see through (an op with
    ``register_autograd`` is no autograd.Function they take)."""
    H, k = x.shape[-1], ids.shape[-1]
    T = math.prod(x.shape[:-1])
    gate = _gate(wgu, wd, activation, interleaved, limit, clamp_after, up_offset)
    y = reference(x.reshape(T, H), ids.reshape(T, k), wts.reshape(T, k), wgu, bgu, wd, bd, gate)
    return y.reshape(x.shape)


def eager_moe_mlp(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved=False, limit=None, clamp_after=False,
                  up_offset=0.0, save_preact=False) -> Tensor:
    """``moe_mlp`` for a caller that runs eagerly (``patch``, the experts switch outside torch.compile): what the op
    computes, minus the dispatcher's layers (autocast, autograd, the op's entry) where nothing needs them.
    ``save_preact``: where a gradient is recorded, ``moe_mlp_save`` (backward "save")."""
    if type(ids) is Tensor and compat.plain_call(x, (wts, wgu, bgu, wd, bd)):
        return _forward(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset)
    if compat.functorch_active():
        return _functorch(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset)
    op = _op(save_preact, x, wts, wgu, bgu, wd, bd)
    return op(x, ids, wts, wgu, bgu, wd, bd, activation, interleaved, limit, clamp_after, up_offset)


def _op(save_preact: bool, *tensors):
    """The op a call with gradients takes: moe_mlp_save's y where asked to save and a gradient is recorded, else
    moe_mlp (traceable by Dynamo)."""
    if save_preact and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _save_y
    return torch.ops.mlp_fuser.moe_mlp.default


def _save_y(*args) -> Tensor:
    return torch.ops.mlp_fuser.moe_mlp_save.default(*args)[0]


def moe_mlp(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor, b_gate_up: Tensor | None,
            w_down: Tensor, b_down: Tensor | None, activation: str, interleaved: bool = False,
            limit: float | None = None, clamp_after: bool = False, up_offset: float = 0.0,
            save_preact: bool = False) -> Tensor:
    """Routed experts as one op: ``torch.ops.mlp_fuser.moe_mlp`` (see the module's docstring). ``save_preact``: keep
    gate/up's output for the backward (``moe_mlp_save``) where a gradient is recorded, instead of recomputing it."""
    if compat.functorch_active():
        return _functorch(x, topk_ids, topk_weights, w_gate_up, b_gate_up, w_down, b_down, activation, interleaved,
                          limit, clamp_after, up_offset)
    op = _op(save_preact, x, topk_weights, w_gate_up, b_gate_up, w_down, b_down)
    return op(x, topk_ids, topk_weights, w_gate_up, b_gate_up, w_down, b_down, activation, interleaved, limit,
              clamp_after, up_offset)


# What Inductor's generated code calls (``mlp_fuser.runtime.inductor``): the op computed right there where it may be
compat.set_op_attribute(inductor.INDUCTOR_NAMES["moe_mlp"], eager_moe_mlp)
