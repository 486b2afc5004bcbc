"""The MLP op family on quantized weights: ``mlp_fuser::quant_mlp``, ``quant_gated_mlp`` and ``quant_linear``.

    quant_gated_mlp(x, w_gate, s_gate, b_gate, w_up, s_up, b_up, w_down, s_down, b_down, activation, weight_format,
                    block) = (act(x @ Wgᵀ + b_gate) * (x @ Wuᵀ + b_up)) @ Wdᵀ + b_down
    quant_mlp(x, w1, s1, b1, w2, s2, b2, activation, weight_format, block) = act(x @ W1ᵀ + b1) @ W2ᵀ + b2
    quant_linear(x, w, s, b, weight_format, block) = x @ Wᵀ + b

where each W is the weight its stored form ``w`` and scales ``s`` describe. ``weight_format`` names the stored form
(a row of ``FORMATS``; ``"fp8_e4m3"`` today: float8_e4m3fn weights with fp32 or UE8M0 scales per block of
``block = [block_n, block_k]`` — transformers' ``FP8Linear`` — per channel or per tensor). Weights are (out, in)
as ``nn.Linear`` stores them; x any leading dimensions, in fp16, bf16 or fp32; the output in x's dtype, as
``FP8Linear`` gives it (no autocast kernel: FP8Linear has none either).

On CUDA the weights are read as stored and dequantized on chip (``kernels/fp8.py``); elsewhere, and where the GPU
has no float8 conversion (before sm89), the aten reference dequantizes each weight and computes in x's dtype.
Weights and scales get no gradient (they are frozen, as in LoRA on an FP8 base); x and the biases do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import compat
from ..activations import get_activation
from ..dispatch import fp8
from ..kernels import fp8 as fp8_kernels
from ..runtime import inductor

FORMATS = ("fp8_e4m3",)
_FLOAT_X = (torch.float16, torch.bfloat16, torch.float32)

_lib = torch.library.Library("mlp_fuser", "FRAGMENT")
_lib.define("quant_linear(Tensor x, Tensor w, Tensor s, Tensor? b, str weight_format, SymInt[]? block=None) "
            "-> Tensor")
_lib.define("quant_mlp(Tensor x, Tensor w1, Tensor s1, Tensor? b1, Tensor w2, Tensor s2, Tensor? b2, "
            "str activation, str weight_format, SymInt[]? block=None) -> Tensor")
_lib.define("quant_gated_mlp(Tensor x, Tensor w_gate, Tensor s_gate, Tensor? b_gate, Tensor w_up, Tensor s_up, "
            "Tensor? b_up, Tensor w_down, Tensor s_down, Tensor? b_down, str activation, str weight_format, "
            "SymInt[]? block=None) -> Tensor")


# ---- checks: each names what was wrong ---------------------------------------------------------------------------


def _weight(name: str, w: Tensor, s: Tensor, fmt: str, block) -> fp8_kernels.Fp8Weight:
    if fmt not in FORMATS:
        raise ValueError(f"mlp_fuser: unknown weight_format {fmt!r}; known: {', '.join(FORMATS)}")
    try:
        return fp8_kernels.fp8_weight(w, s, block)
    except ValueError as e:
        raise ValueError(f"{str(e).removesuffix('.')} (argument '{name}')") from None


def _check(x: Tensor, weights: Sequence[tuple[str, fp8_kernels.Fp8Weight, Tensor | None]], activation) -> None:
    if x.dtype not in _FLOAT_X:
        raise TypeError(f"mlp_fuser: x must be float16, bfloat16 or float32 for quantized weights, got {x.dtype}")
    if activation is not None:
        get_activation(activation)
    width = x.shape[-1]
    for i, (name, fw, b) in enumerate(weights):
        N, K = fw.w.shape
        if K != width:
            what = "x's last dimension" if i == 0 or (len(weights) == 3 and i == 1) else "the previous output"
            raise ValueError(f"mlp_fuser: {name} is {tuple(fw.w.shape)}: its in-features {K} != {what} {width}")
        if fw.w.device != x.device or fw.scale.device != x.device:
            raise ValueError(f"mlp_fuser: {name} and its scales must be on x's device {x.device}")
        if b is not None and (b.shape != (N,) or b.device != x.device):
            raise ValueError(f"mlp_fuser: the bias of {name} must be ({N},) on {x.device}, got {tuple(b.shape)}")
        if not (len(weights) == 3 and i == 0):  # gate and up both read x
            width = N
    if len(weights) == 3 and weights[0][1].w.shape != weights[1][1].w.shape:
        raise ValueError(f"mlp_fuser: w_gate {tuple(weights[0][1].w.shape)} and w_up {tuple(weights[1][1].w.shape)} "
                         "differ in shape")


def why_not_kernels(x: Tensor) -> str | None:
    """Why the FP8 kernels cannot run for x (the aten reference runs instead), or None."""
    device = x.device
    return fp8.why_not_kernels(device.type, device.index)


def _problem(x: Tensor, M: int, weights) -> fp8.Problem:
    device = x.device
    if weights is None:
        return fp8.Problem(device.type, x.dtype, M, device.index)
    return fp8.Problem(device.type, x.dtype, M, device.index, fp8.cublas_format(weights), fp8.a8_format(weights))


def choose(x: Tensor, M: int, weights=None) -> str:
    """The row of the FP8 table (``dispatch/fp8.py``) that runs a call with x and M rows (``weights``: the call's
    ``[(name, Fp8Weight, bias)]``, whose format some rows need; without them those rows are passed over)."""
    return fp8.choose(_problem(x, M, weights)).name


def describe(x: Tensor, M: int, weights=None) -> str:
    """Which implementation runs a call with x and M rows, and why each one above it does not."""
    return fp8.describe(_problem(x, M, weights))


# ---- forward -------------------------------------------------------------------------------------------------


def _weights(names, args, fmt, block):
    """[(name, Fp8Weight, bias)] from the op's (w, s, b) argument triples."""
    return [(n, _weight(n, args[3 * i], args[3 * i + 1], fmt, block), args[3 * i + 2]) for i, n in enumerate(names)]


_SEEN: dict[tuple, list] = {}  # _signature -> each weight's (block_n, block_k), None where fp8_weight views its scales
_MAX_SEEN = 4096  # a process that sees endless new shapes starts afresh rather than growing the dict


def _signature(x: Tensor, args: tuple, fmt, block, activation) -> tuple:
    """Everything ``_weights`` and ``_check`` read, and the plans: each tensor's shape, strides, dtype and device, and
    the other arguments."""
    return (x.shape, x.stride(), x.dtype, x.device, fmt, None if block is None else tuple(block), activation,
            *[None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in args])


def _call(names, x: Tensor, args: tuple, fmt, block, activation, gated: bool) -> Tensor:
    """The op's value for the (w, s, b) triples ``args``: checked, then the row the dispatcher chose for the call's
    signature (``dispatch/fp8.run``). A signature that passed the checks before proves them: its weights are built
    from what the first call found (scales used as given where ``fp8_weight`` kept them so)."""
    try:
        key = _signature(x, args, fmt, block, activation)
        seen = _SEEN.get(key)
    except (TypeError, AttributeError):  # an argument of a wrong type: the checks name it
        key = seen = None
    if seen is None:
        weights = _weights(names, args, fmt, block)
        _check(x, weights, activation)
        if key is not None:
            if len(_SEEN) >= _MAX_SEEN:
                _SEEN.clear()
            _SEEN[key] = [fp8_kernels.format_as_given(fw, args[3 * i + 1]) for i, (_, fw, _) in enumerate(weights)]
    else:
        weights = [(n, fp8_kernels.Fp8Weight(args[3 * i], args[3 * i + 1], *blocks) if blocks is not None
                    else _weight(n, args[3 * i], args[3 * i + 1], fmt, block), args[3 * i + 2])
                   for i, (n, blocks) in enumerate(zip(names, seen))]
    return fp8.run(x, weights, activation, gated, key)


def _quant_linear(x, w, s, b, weight_format, block=None):
    return _call(("w",), x, (w, s, b), weight_format, block, None, False)


def _quant_mlp(x, w1, s1, b1, w2, s2, b2, activation, weight_format, block=None):
    return _call(("w1", "w2"), x, (w1, s1, b1, w2, s2, b2), weight_format, block, activation, False)


def _quant_gated_mlp(x, w_gate, s_gate, b_gate, w_up, s_up, b_up, w_down, s_down, b_down, activation, weight_format,
                     block=None):
    return _call(("w_gate", "w_up", "w_down"), x, (w_gate, s_gate, b_gate, w_up, s_up, b_up, w_down, s_down, b_down),
                 weight_format, block, activation, True)


compute_linear, compute_mlp, compute_gated_mlp = _quant_linear, _quant_mlp, _quant_gated_mlp  # patch's plain calls
for _name, _fn in (("quant_linear", _quant_linear), ("quant_mlp", _quant_mlp), ("quant_gated_mlp", _quant_gated_mlp)):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::quant_linear", lib=_lib)
def _quant_linear_fake(x, w, s, b, weight_format, block=None):
    inductor.install_if_inductor()  # the graph being traced may go to Inductor: its code then calls our entry
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.register_fake("mlp_fuser::quant_mlp", lib=_lib)
def _quant_mlp_fake(x, w1, s1, b1, w2, s2, b2, activation, weight_format, block=None):
    inductor.install_if_inductor()
    return x.new_empty((*x.shape[:-1], w2.shape[0]))


@torch.library.register_fake("mlp_fuser::quant_gated_mlp", lib=_lib)
def _quant_gated_mlp_fake(x, w_gate, s_gate, b_gate, w_up, s_up, b_up, w_down, s_down, b_down, activation,
                          weight_format, block=None):
    inductor.install_if_inductor()
    return x.new_empty((*x.shape[:-1], w_down.shape[0]))


# ---- calls from our own code: Inductor's generated code (``mlp_fuser.runtime.inductor``), the backward ------------


def _here_or_op(name: str, compute):
    """Op ``name`` for a caller of ours: ``compute`` right there where nothing needs the dispatcher's layers (no
    gradient, mode, tracer or profiler), else the registered op (which a tracer records as one node)."""
    op = getattr(torch.ops.mlp_fuser, name).default

    def call(x, *args):
        if compat.plain_call(x, [a for a in args if a is None or isinstance(a, Tensor)]):
            return compute(x, *args)
        return op(x, *args)
    call.__name__ = f"{name}_here_or_op"
    return call


_ENTRIES = {name: _here_or_op(name, fn) for name, fn in (("quant_linear", _quant_linear), ("quant_mlp", _quant_mlp),
                                                          ("quant_gated_mlp", _quant_gated_mlp))}
for _name, _fn in _ENTRIES.items():
    compat.set_op_attribute(inductor.INDUCTOR_NAMES[_name], _fn)


# ---- backward: x and the biases (the quantized weights are frozen) ----------------------------------------------


_lib.define("quant_linear_t(Tensor dy, Tensor w, Tensor s, str weight_format, SymInt[]? block=None) -> Tensor")


def _linear_t(dy: Tensor, fw: fp8_kernels.Fp8Weight) -> Tensor:
    """dy @ W (W = fw's weight, (N, K)): the weight read transposed where it lies, on chip where the forward's rows
    run the kernels (CUDA; the CPU under ``config.triton_on_cpu``)."""
    if fp8.kernels_why_not(dy.device.type, dy.device.index) is None:
        wt = fp8_kernels.Fp8Weight(fw.w.t(), fw.scale.t(), fw.block_k, fw.block_n)
        return fp8_kernels.fp8_linear(dy.reshape(-1, dy.shape[-1]), wt).reshape(*dy.shape[:-1], fw.w.shape[1])
    return dy @ fp8_kernels.dequantize(fw, dy.dtype)


def _quant_linear_t(dy, w, s, weight_format, block=None):
    return _linear_t(dy, _weight("w", w, s, weight_format, block))


_lib.impl("quant_linear_t", _quant_linear_t, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::quant_linear_t", lib=_lib)
def _quant_linear_t_fake(dy, w, s, weight_format, block=None):
    return dy.new_empty((*dy.shape[:-1], w.shape[1]))


def _linear_t_backward(ctx, g):  # d(dy @ W) / d dy = g @ Wᵀ (double backward)
    _, w, s, fmt, block = _inputs(ctx)
    return quant_linear(g, w, s, None, fmt, block), None, None, None, None


# Inside a backward, (dy, w, s, fmt, block) -> dy @ W and (x, w, s, b, fmt, block) -> x @ Wᵀ + b (recomputed): ops
# where a tracer looks (a compiled backward traces AOTAutograd's fake tensors, which the kernels cannot launch on)
_t, _pre = _here_or_op("quant_linear_t", _quant_linear_t), _ENTRIES["quant_linear"]


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*(t if isinstance(t, Tensor) else None for t in inputs))
    ctx.rest = [None if isinstance(t, Tensor) else t for t in inputs]


def _inputs(ctx):
    return [t if r is None else r for t, r in zip(ctx.saved_tensors, ctx.rest)]


def _bias_grad(b, d):
    return None if b is None or not b.requires_grad else d.reshape(-1, d.shape[-1]).sum(0).to(b.dtype)


def _linear_backward(ctx, dy):
    x, w, s, b, fmt, block = _inputs(ctx)
    return _t(dy, w, s, fmt, block), None, None, _bias_grad(b, dy), None, None


def _mlp_backward(ctx, dy):
    x, w1, s1, b1, w2, s2, b2, activation, fmt, block = _inputs(ctx)
    act = get_activation(activation)
    g = _pre(x, w1, s1, b1, fmt, block)
    dg = _t(dy, w2, s2, fmt, block) * act.grad(g)
    return _t(dg, w1, s1, fmt, block), None, None, _bias_grad(b1, dg), None, None, _bias_grad(b2, dy), None, None, None


def _gated_mlp_backward(ctx, dy):
    x, wg, sg, bg, wu, su, bu, wd, sd, bd, activation, fmt, block = _inputs(ctx)
    act = get_activation(activation)
    g, u = _pre(x, wg, sg, bg, fmt, block), _pre(x, wu, su, bu, fmt, block)
    dh = _t(dy, wd, sd, fmt, block)
    dg, du = dh * u * act.grad(g), dh * act.fn(g)
    dx = _t(dg, wg, sg, fmt, block) + _t(du, wu, su, fmt, block)
    return (dx, None, None, _bias_grad(bg, dg), None, None, _bias_grad(bu, du), None, None, _bias_grad(bd, dy),
            None, None, None)


torch.library.register_autograd("mlp_fuser::quant_linear_t", _linear_t_backward, setup_context=_setup, lib=_lib)
torch.library.register_autograd("mlp_fuser::quant_linear", _linear_backward, setup_context=_setup, lib=_lib)
torch.library.register_autograd("mlp_fuser::quant_mlp", _mlp_backward, setup_context=_setup, lib=_lib)
torch.library.register_autograd("mlp_fuser::quant_gated_mlp", _gated_mlp_backward, setup_context=_setup, lib=_lib)


def quant_gated_mlp(x: Tensor, w_gate: Tensor, s_gate: Tensor, b_gate: Tensor | None, w_up: Tensor, s_up: Tensor,
                    b_up: Tensor | None, w_down: Tensor, s_down: Tensor, b_down: Tensor | None, activation: str,
                    weight_format: str = "fp8_e4m3", block: Sequence[int] | None = None) -> Tensor:
    return torch.ops.mlp_fuser.quant_gated_mlp(x, w_gate, s_gate, b_gate, w_up, s_up, b_up, w_down, s_down, b_down,
                                               activation, weight_format, list(block) if block else None)


def quant_mlp(x: Tensor, w1: Tensor, s1: Tensor, b1: Tensor | None, w2: Tensor, s2: Tensor, b2: Tensor | None,
              activation: str, weight_format: str = "fp8_e4m3", block: Sequence[int] | None = None) -> Tensor:
    return torch.ops.mlp_fuser.quant_mlp(x, w1, s1, b1, w2, s2, b2, activation, weight_format,
                                         list(block) if block else None)


def quant_linear(x: Tensor, w: Tensor, s: Tensor, b: Tensor | None, weight_format: str = "fp8_e4m3",
                 block: Sequence[int] | None = None) -> Tensor:
    return torch.ops.mlp_fuser.quant_linear(x, w, s, b, weight_format, list(block) if block else None)
