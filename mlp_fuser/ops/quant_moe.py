"""Routed experts on quantized weights: ``mlp_fuser::quant_moe_mlp``, ``moe_mlp`` with its weights stored as
transformers' ``FP8Experts`` stores them.

    quant_moe_mlp(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down, activation, weight_format,
                  block=None, interleaved=False, limit=None, clamp_after=False, up_offset=0.0)
    = moe_mlp(x, topk_ids, topk_weights, W_gate_up, None, W_down, None, activation, interleaved, limit, clamp_after,
              up_offset)

where each W is the weight its stored form ``w`` (E, N, K) and scales ``s`` describe (``kernels.fp8.fp8_experts``:
``weight_format`` "fp8_e4m3", float8_e4m3fn weights with fp32 or UE8M0 scales per ``block = [block_n, block_k]``,
gate and up quantized as one or apart, per channel, per tensor). No biases (``FP8Experts`` has none). Expert ids
>= E contribute nothing; x in fp16, bf16 or fp32, the output in x's dtype.

On CUDA from sm89 the experts kernels (``kernels/moe.py``: the sorted grouped GEMMs at every size; the rows of
``dispatch/fp8_experts.py``) read the float8 weights as stored and multiply them with x and h quantized per row and
128 columns (W8A8, transformers' dynamic scheme; W8A16, each tile cast in registers, where ``config.fp8_w8a8`` is
off). Elsewhere the aten reference
dequantizes each expert's weights to x's dtype and runs ``moe.reference``. The weights and scales are frozen; x and
topk_weights get gradients (``register_autograd``: the inputs saved; the backward is the op
``quant_moe_mlp_backward``, eager and compiled alike): on CUDA the experts' Triton backward reading the float8
weights as stored (``kernels/moe_backward.py``, each tile dequantized in registers: no copy of a weight), elsewhere
autograd through the dequantized reference; with create_graph=True that reference, differentiable again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import compat
from ..dispatch import fp8_experts
from ..kernels import fp8 as fp8_kernels
from ..runtime import inductor
from . import moe
from .quant import FORMATS

_FLOAT_X = (torch.float16, torch.bfloat16, torch.float32)

_lib = torch.library.Library("mlp_fuser", "FRAGMENT")
_lib.define(
    "quant_moe_mlp(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor s_gate_up, "
    "Tensor w_down, Tensor s_down, str activation, str weight_format, SymInt[]? block=None, bool interleaved=False, "
    "float? limit=None, bool clamp_after=False, float up_offset=0.0) -> Tensor")


def _experts(name: str, w: Tensor, s: Tensor, fmt: str, block, gated: bool, interleaved: bool):
    if fmt not in FORMATS:
        raise ValueError(f"mlp_fuser: unknown weight_format {fmt!r}; known: {', '.join(FORMATS)}")
    try:
        return fp8_kernels.fp8_experts(w, s, block, gated, interleaved)
    except ValueError as e:
        raise ValueError(f"{str(e).removesuffix('.')} (argument '{name}')") from None


def _checked(x, ids, wts, wgu, sgu, wd, sd, activation, fmt, block, interleaved, limit, clamp_after, up_offset):
    """(Fp8Experts of gate/up, of down, Gate) for a call, or TypeError / ValueError naming what was wrong."""
    if x.dtype not in _FLOAT_X:
        raise TypeError(f"mlp_fuser::quant_moe_mlp: x must be float16, bfloat16 or float32, got {x.dtype}")
    if wgu.dim() != 3 or wd.dim() != 3:
        raise ValueError(f"mlp_fuser::quant_moe_mlp: w_gate_up and w_down must be 3-D, got {tuple(wgu.shape)} and "
                         f"{tuple(wd.shape)}")
    gated = wgu.shape[1] == 2 * wd.shape[2]
    fgu = _experts("w_gate_up", wgu, sgu, fmt, block, gated, bool(interleaved))
    fd = _experts("w_down", wd, sd, fmt, block, False, False)
    _check_shapes(x, ids, wts, wgu, wd, activation)
    for name, t in (("s_gate_up", sgu), ("s_down", sd)):
        if t.device != x.device:
            raise ValueError(f"mlp_fuser::quant_moe_mlp: {name} is on {t.device} but x is on {x.device}")
    return fgu, fd, moe._gate(wgu, wd, activation, interleaved, limit, clamp_after, up_offset)


def _check_shapes(x, ids, wts, wgu, wd, activation) -> None:
    """moe_mlp's checks on x, the routing and the weights' shapes and devices (not their dtypes: float8 here)."""
    fake = [torch.empty_strided(t.shape, t.stride(), dtype=x.dtype, device="meta") for t in (wgu, wd)]
    problem = moe._problem(x.to("meta") if x.device.type != "meta" else x, ids.to("meta"), wts.to("meta"), fake[0],
                           None, fake[1], None, activation)
    if problem is None:
        for name, t in (("topk_ids", ids), ("topk_weights", wts), ("w_gate_up", wgu), ("w_down", wd)):
            if t.device != x.device:
                raise ValueError(f"mlp_fuser::quant_moe_mlp: {name} is on {t.device} but x is on {x.device}")
        return
    exc, msg = problem
    raise exc(f"mlp_fuser::quant_moe_mlp: {msg}")


# ---- forward: the row the dispatcher's FP8 experts table chooses (dispatch/fp8_experts.py) -------------------------


def _flat(x, ids, wts):
    """(T, x, ids, wts) as (T, H), (T, k), (T, k): the tensors themselves where they are (patch's calls)."""
    if x.dim() == 2 and ids.dim() == 2 and wts.dim() == 2:
        return x.shape[0], x, ids, wts
    H, k = x.shape[-1], ids.shape[-1]
    T = math.prod(x.shape[:-1])
    return T, x.reshape(T, H), ids.reshape(T, k), wts.reshape(T, k)


_SEEN: dict[tuple, tuple] = {}  # _signature -> (the Gate, each weight's format_as_given) of a checked call
_MAX_SEEN = 4096  # a process that sees endless new shapes starts afresh rather than growing the dict


def _signature(x, ids, wts, wgu, sgu, wd, sd, activation, fmt, block, interleaved, limit, clamp_after,
               up_offset) -> tuple:
    """Everything ``_checked`` reads: each tensor's shape, strides, dtype and device, and the other arguments."""
    return (activation, fmt, None if block is None else tuple(block), interleaved, limit, clamp_after, up_offset,
            *[(t.shape, t.stride(), t.dtype, t.device) for t in (x, ids, wts, wgu, sgu, wd, sd)])


def _prepared(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block, interleaved, limit, clamp_after,
              up_offset) -> tuple:
    """(signature or None, Fp8Experts of gate/up, of down, Gate) of a call; a call whose signature passed the checks
    before skips them (the ids' check stays) and builds its weights' views from what the first call found."""
    try:
        key = _signature(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block, interleaved, limit,
                         clamp_after, up_offset)
        seen = _SEEN.get(key)
    except (TypeError, AttributeError):  # an argument of a wrong type: the checks name it
        key = seen = None
    if seen is None:
        fgu, fd, gate = _checked(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block, interleaved, limit,
                                 clamp_after, up_offset)
        if key is not None:
            if len(_SEEN) >= _MAX_SEEN:
                _SEEN.clear()
            _SEEN[key] = (gate, fp8_kernels.format_as_given(fgu, sgu), fp8_kernels.format_as_given(fd, sd))
    else:
        gate, gu, d = seen
        fgu = fp8_kernels.Fp8Experts(wgu, sgu, *gu) if gu else fp8_kernels.fp8_experts(wgu, sgu, block, gate.gated,
                                                                                       gate.interleaved)
        fd = fp8_kernels.Fp8Experts(wd, sd, *d) if d else fp8_kernels.fp8_experts(wd, sd, block)
    moe._check_ids(ids)
    return key, fgu, fd, gate


def _forward(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block=None, interleaved=False, limit=None,
             clamp_after=False, up_offset=0.0):
    """The op on real tensors: the row the dispatcher chose for the call's signature."""
    key, fgu, fd, gate = _prepared(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block, interleaved,
                                   limit, clamp_after, up_offset)
    T, x2, ids2, wts2 = _flat(x, ids, wts)
    if T == 0:
        return x.new_zeros(x.shape)
    y = fp8_experts.run(x2, ids2, wts2, fgu, fd, gate, key)
    return y if x2 is x else y.view(*x.shape)


_lib.impl("quant_moe_mlp", moe._own_tensor(_forward), "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::quant_moe_mlp", lib=_lib)
def _fake(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block=None, interleaved=False, limit=None,
          clamp_after=False, up_offset=0.0):
    _checked(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block, interleaved, limit, clamp_after,
             up_offset)
    inductor.install_if_inductor()  # the graph being traced may go to Inductor: its code then calls our entry
    return x.new_empty(x.shape)


# ---- backward: dx and d topk_weights (the float8 weights and their scales are frozen) ------------------------------

_lib.define(
    "quant_moe_mlp_backward(Tensor dy, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, "
    "Tensor s_gate_up, Tensor w_down, Tensor s_down, str activation, str weight_format, SymInt[]? block, "
    "bool interleaved, float? limit, bool clamp_after, float up_offset, bool need_dx) -> (Tensor, Tensor)")


def _backward(dy, x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block, interleaved, limit, clamp_after,
              up_offset, need_dx):
    """(dx, d topk_weights) on real tensors, dx empty (0,) without ``need_dx``: the row the dispatcher's backward
    table chooses (``fp8_experts.BACKWARD_IMPLS``: the Triton backward on the float8 weights, else autograd through
    the dequantized reference)."""
    _, fgu, fd, gate = _prepared(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block, interleaved, limit,
                                 clamp_after, up_offset)
    T, x2, ids2, wts2 = _flat(x, ids, wts)
    if T == 0:
        dx, dwts = torch.zeros_like(x), torch.zeros_like(wts)
    else:
        impl = fp8_experts.choose_backward(fp8_experts.backward_problem(x2, ids2, fgu, fd, gate))
        dx, dwts = impl.fn(x2, ids2, wts2, fgu, fd, gate, dy.reshape(T, x.shape[-1]), need_dx)
    return (dx.reshape(x.shape).contiguous() if need_dx else x.new_empty(0),
            dwts.reshape(wts.shape).contiguous().to(wts.dtype))


_lib.impl("quant_moe_mlp_backward", _backward, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::quant_moe_mlp_backward", lib=_lib)
def _backward_fake(dy, x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block, interleaved, limit,
                   clamp_after, up_offset, need_dx):
    return x.new_empty(x.shape) if need_dx else x.new_empty(0), wts.new_empty(wts.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])  # the inputs alone: the backward recomputes gate/up from x
    ctx.options = inputs[7:]


def _differentiable_backward(ctx, dy, need_dx: bool, need_wts: bool) -> tuple:
    """create_graph=True: dx and dwts by autograd through the dequantized reference, differentiable again."""
    x, ids, wts, wgu, sgu, wd, sd = ctx.saved_tensors
    fgu, fd, gate = _checked(x, ids, wts, wgu, sgu, wd, sd, *ctx.options)
    T, x2, ids2, wts2 = _flat(x, ids, wts)
    y = fp8_experts.dequantized(x2, ids2, wts2, fgu, fd, gate)
    asked = [t for t, need in ((x, need_dx), (wts, need_wts)) if need]
    got = iter(torch.autograd.grad(y, asked, dy.reshape(y.shape), create_graph=True))
    return next(got) if need_dx else None, next(got) if need_wts else None


def _autograd_backward(ctx, dy):
    """The op's backward: ``quant_moe_mlp_backward``, in eager mode as in a compiled graph; no weight gradients."""
    need_dx, need_wts = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if not (need_dx or need_wts):  # only the weights or scales ask (transformers' FP8 Parameters do): frozen
        return (None,) * 14
    if torch.is_grad_enabled():
        dx, dwts = _differentiable_backward(ctx, dy, need_dx, need_wts)
    else:
        saved = ctx.saved_tensors
        if compat.plain_call(dy, saved[:1] + saved[2:]):
            dx, dwts = _backward(dy, *saved, *ctx.options, need_dx)
        else:  # the op where a mode or a tracer must see it
            dx, dwts = torch.ops.mlp_fuser.quant_moe_mlp_backward.default(dy, *saved, *ctx.options, need_dx)
    return (dx if need_dx else None, None, dwts if need_wts else None, *(None,) * 11)


torch.library.register_autograd("mlp_fuser::quant_moe_mlp", _autograd_backward, setup_context=_setup_context,
                                lib=_lib)


def eager_quant_moe_mlp(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block=None, interleaved=False,
                        limit=None, clamp_after=False, up_offset=0.0) -> Tensor:
    """``quant_moe_mlp`` for a caller that runs eagerly (``patch``, the experts switch outside torch.compile): the op's
    value computed right there where the dispatcher's layers (autocast, autograd, fake tensors) have nothing to do."""
    if (type(ids) is Tensor and compat.plain_operands(x, (wts, wgu, sgu, wd, sd))
            and not (torch.is_grad_enabled() and compat.any_requires_grad(x, wts))):
        return _forward(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block, interleaved, limit,
                        clamp_after, up_offset)
    return torch.ops.mlp_fuser.quant_moe_mlp.default(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block,
                                                     interleaved, limit, clamp_after, up_offset)


def quant_moe_mlp(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor, s_gate_up: Tensor,
                  w_down: Tensor, s_down: Tensor, activation: str, weight_format: str = "fp8_e4m3",
                  block: Sequence[int] | None = None, interleaved: bool = False, limit: float | None = None,
                  clamp_after: bool = False, up_offset: float = 0.0) -> Tensor:
    """Routed experts on quantized weights as one op: ``torch.ops.mlp_fuser.quant_moe_mlp`` (the module's docstring)."""
    return torch.ops.mlp_fuser.quant_moe_mlp.default(x, topk_ids, topk_weights, w_gate_up, s_gate_up, w_down, s_down,
                                                     activation, weight_format, list(block) if block else None,
                                                     interleaved, limit, clamp_after, up_offset)


# What Inductor's generated code calls (``mlp_fuser.runtime.inductor``): the op computed right there where it may be
compat.set_op_attribute(inductor.INDUCTOR_NAMES["quant_moe_mlp"], eager_quant_moe_mlp)
