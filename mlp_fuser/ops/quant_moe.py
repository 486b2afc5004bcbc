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
dequantizes each expert's weights to x's dtype and runs ``moe.reference``. The weights are frozen; x and
topk_weights get gradients, through that reference on the dequantized weights (on CUDA too: a dequantized copy per
call where gradients are needed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import compat
from ..dispatch import fp8_experts
from ..kernels import fp8 as fp8_kernels
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


def _forward(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block=None, interleaved=False, limit=None,
             clamp_after=False, up_offset=0.0):
    """The op on real tensors; a call whose signature passed the checks before skips them (the ids' check stays)
    and builds its weights' views from what the first call found."""
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
    T, x2, ids2, wts2 = _flat(x, ids, wts)
    if T == 0:
        return x.new_zeros(x.shape)
    y = fp8_experts.run(x2, ids2, wts2, fgu, fd, gate, key)
    return y if x2 is x else y.view(*x.shape)


_lib.impl("quant_moe_mlp", _forward, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::quant_moe_mlp", lib=_lib)
def _fake(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block=None, interleaved=False, limit=None,
          clamp_after=False, up_offset=0.0):
    _checked(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block, interleaved, limit, clamp_after,
             up_offset)
    return x.new_empty(x.shape)


def _autograd(keyset, x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block=None, interleaved=False,
              limit=None, clamp_after=False, up_offset=0.0):
    """With gradients needed (x or topk_weights): the reference on the dequantized weights, which autograd
    differentiates; else the op below autograd."""
    if torch.is_grad_enabled() and compat.any_requires_grad(x, wts):
        fgu, fd, gate = _checked(x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block, interleaved, limit,
                                 clamp_after, up_offset)
        moe._check_ids(ids)
        T, x2, ids2, wts2 = _flat(x, ids, wts)
        return fp8_experts.dequantized(x2, ids2, wts2, fgu, fd, gate).view(x.shape)
    with compat.below_autograd():
        return torch.ops.mlp_fuser.quant_moe_mlp.default.redispatch(
            keyset & compat.AFTER_AUTOGRAD, x, ids, wts, wgu, sgu, wd, sd, activation, weight_format, block,
            interleaved, limit, clamp_after, up_offset)


_lib.impl("quant_moe_mlp", _autograd, "Autograd", with_keyset=True)


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
