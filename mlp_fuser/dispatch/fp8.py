"""The FP8-weight MLP ops' implementations (``quant_linear``, ``quant_mlp``, ``quant_gated_mlp``: ``ops/quant.py``) as
rows of the one dispatcher's table (``core``). Not timed: from the top down, the first row that runs a call runs it
(or the one ``config.force_impl`` names). A row's ``fn(x, weights, activation, gated)`` takes x as given and the
checked weights ``[(name, Fp8Weight, bias)]`` (one: a linear; two: an MLP; three: gate, up, down).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import config
from ..activations import get_activation
from ..kernels import fp8 as fp8_kernels
from ..kernels import fp8_cublas
from ..reference import reference_mlp
from . import core
from .core import Impl


class Problem(NamedTuple):
    device: str  # x's device type
    dtype: torch.dtype
    M: int  # x's rows
    index: int | None = None  # x's CUDA device (its capability decides)
    cublas_format: str | None = "the weights not given"  # why cuBLAS' blockwise recipe cannot read them, or None
    a8_format: str | None = None  # why the W8A8 kernels cannot read them, or None

    @property
    def rows(self) -> int:
        return self.M


def why_not_kernels(device: str, index: int | None) -> str | None:
    """Why the FP8 kernels cannot run on the device (its type, its index) (the aten reference runs instead), or None."""
    if device != "cuda":
        return f"x is on {device}: the FP8 kernels run on CUDA"
    if torch.cuda.get_device_capability(index) < (8, 9):
        return "the GPU has no float8 conversion (before sm89): the weights are dequantized per call"
    return None


def kernels_why_not(device: str, index: int | None) -> str | None:
    """``why_not_kernels`` for a call's rows: the CPU runs the kernels too under ``config.triton_on_cpu``."""
    return None if device == "cpu" and config.triton_on_cpu else why_not_kernels(device, index)


def kernels_run(p) -> str | None:
    """``kernels_why_not`` as a table's rule: ``p`` any problem with a ``device`` type and ``index``."""
    return kernels_why_not(p.device, p.index)


def _a8_on(p: Problem) -> str | None:
    return None if config.fp8_w8a8 else "mlp_fuser.config.fp8_w8a8 is off: the activations keep their dtype"


def _kernels(a8: bool):
    """(fn, plan) of the FP8 kernels (``kernels/fp8.py``): x quantized per token and 128 columns (``a8``) or as it
    is. ``plan(args)``: for calls like ``args`` = (x, weights, activation, gated), a function of (x, weights) with
    every launch worked out once; None where gate or up has a bias (their product runs in aten)."""
    def plan(args: tuple):
        x, weights, activation, gated = args
        x2 = x.reshape(-1, x.shape[-1])
        if len(weights) == 1:
            (_, w, b), = weights
            one = fp8_kernels.linear_plan(x2, w, bias=b, a8=a8)

            def linear(x2, weights):
                (_, w, b), = weights
                return one(x2, w, None, b)
            return _on_rows(x, weights, linear)
        (_, w1, b1), *rest = weights
        if gated and (b1 is not None or rest[0][2] is not None):
            return None
        wu = rest[0][1] if gated else None
        first = fp8_kernels.linear_plan(x2, w1, wu, None if gated else b1, activation, a8)
        _, wd, bd = rest[-1]
        h = torch.empty((x2.shape[0], w1.w.shape[0]), dtype=x.dtype, device=x.device)  # a stand-in: its layout
        second = fp8_kernels.linear_plan(h, wd, bias=bd, a8=a8)

        def mlp(x2, weights):
            (_, w1, b1), *rest = weights
            h = first(x2, w1, rest[0][1] if gated else None, None if gated else b1)
            _, wd, bd = rest[-1]
            return second(h, wd, None, bd)
        return _on_rows(x, weights, mlp)

    def fn(x: Tensor, weights, activation, gated: bool) -> Tensor:
        p = plan((x, weights, activation, gated))
        if p is not None:
            return p(x, weights)
        (_, w1, b1), (_, wu, bu), (_, wd, bd) = weights  # gated, with biases before the product: in aten
        x2 = x.reshape(-1, x.shape[-1])
        h = (get_activation(activation).fn(fp8_kernels.fp8_linear(x2, w1, bias=b1, a8=a8))
             * fp8_kernels.fp8_linear(x2, wu, bias=bu, a8=a8))
        y = fp8_kernels.fp8_linear(h, wd, bias=bd, a8=a8)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return fn, plan


def dequantized(x: Tensor, weights, activation, gated: bool) -> Tensor:
    """Each weight dequantized to x's dtype, then the unfused math (transformers' dequantized path)."""
    deq = [(fp8_kernels.dequantize(fw, x.dtype), b) for _, fw, b in weights]
    if len(deq) == 1:
        return F.linear(x, *deq[0])
    (w1, b1), *rest = deq
    if gated:
        (wu, bu), (wd, bd) = rest
        return reference_mlp(x, w1, b1, wu, bu, wd, bd, activation)
    (wd, bd), = rest
    return reference_mlp(x, w1, b1, None, None, wd, bd, activation)


CUBLAS_FROM_M = 128  # rows from which cuBLAS' blockwise GEMMs beat the fused kernels (H200: benchmarks/NOTES.md)


def _cublas_m(p: Problem) -> str | None:
    return None if p.M >= CUBLAS_FROM_M else f"M = {p.M} < {CUBLAS_FROM_M}: the fused kernels are faster"


def _cublas_device(p: Problem) -> str | None:
    return fp8_cublas.why_not_device(p.index)


def _cublas(x: Tensor, weights, activation, gated: bool) -> Tensor:
    """The op on cuBLAS' blockwise GEMMs (``kernels/fp8_cublas.py``), x 2-D inside."""
    x2 = x.reshape(-1, x.shape[-1])
    if len(weights) == 1:
        (_, w, b), = weights
        y = fp8_cublas.linear(x2, w, b)
    else:
        y = fp8_cublas.mlp(x2, weights, activation, gated)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _cublas_plan(args: tuple):
    """``_cublas`` for calls like ``args`` = (x, weights, activation, gated): a function of (x, weights), its
    launches, row padding and scale layouts worked out once (``fp8_cublas.linear_plan`` / ``mlp_plan``). Where torch
    refuses a call (a layout or shape its version does not take), the row is dropped for the device and the call
    runs on the next row."""
    x, weights, activation, gated = args
    planned = _cublas_planned(args)

    def guarded(x, weights):
        try:
            return planned(x, weights)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, NotImplementedError) as e:
            fp8_cublas.refused(x.device.index, e)
            _PLANS.clear()
            return run(x, weights, activation, gated, None)
    return guarded


def _cublas_planned(args: tuple):
    x, weights, activation, gated = args
    x2 = x.reshape(-1, x.shape[-1])
    if len(weights) == 1:
        one = fp8_cublas.linear_plan(x2, weights[0][1])

        def linear(x2, weights):
            (_, w, b), = weights
            return one(x2, w, b)
        return _on_rows(x, weights, linear)
    return _on_rows(x, weights, fp8_cublas.mlp_plan(x2, weights, activation, gated))


def _on_rows(x: Tensor, weights, plan2d):
    """A plan of 2-D x, ``plan2d(x2, weights)``, as one of x's shape: x's rows in, the output's leading dims back."""
    rows = tuple(x.reshape(-1, x.shape[-1]).shape)  # ints: reshape reads them faster than a Size
    out = (*x.shape[:-1], weights[-1][1].w.shape[0])

    def planned(x, weights):
        return plan2d(x.reshape(*rows), weights).reshape(*out)
    return planned


def cublas_format(weights) -> str | None:
    """Why cuBLAS' blockwise recipe cannot read these checked weights, or None."""
    return next((f"{name}: {why}" for name, fw, _ in weights if (why := fp8_cublas.why_not_format(fw))), None)


def a8_format(weights) -> str | None:
    """Why the W8A8 kernels cannot read these checked weights, or None."""
    return next((f"{name}: {why}" for name, fw, _ in weights if (why := fp8_kernels.a8_weight_why_not(fw))), None)


def _row(name: str, a8: bool, *why) -> Impl:
    fn, plan = _kernels(a8)
    return Impl(name, fn, None, None, why=why, plan=plan)


IMPLS: list[Impl] = [  # from the top down, the first that can run a call runs it
    # prefill sizes, 128 x 128 blocks: cuBLAS' blockwise-scaled GEMMs, act · up in aten between them
    Impl("fp8_cublas_blockwise", _cublas, None, frozenset({torch.float16, torch.bfloat16}),
         why=(kernels_run, _a8_on, _cublas_m, lambda p: p.cublas_format, _cublas_device), plan=_cublas_plan),
    # x quantized per token and 128 columns, the fp8 tensor cores multiply: fastest
    _row("fp8_w8a8", True, kernels_run, _a8_on, lambda p: p.a8_format),
    _row("fp8_w8a16", False, kernels_run),  # weights cast on chip, x as it is
    Impl("aten_dequantize", dequantized, None, None),  # each weight dequantized to x's dtype, then aten
]
FP8 = core.Registry("fp8", IMPLS, None)


def choose(p: Problem) -> Impl:
    return core.first(FP8, p)


_PLANS: dict = {}  # (the op's signature of a call, the settings) -> (the row chosen, its plan or None)
_MAX_PLANS = 1024


def run(x: Tensor, weights, activation, gated: bool, signature: tuple | None) -> Tensor:
    """One checked call: the row chosen for its signature (the op's key of everything the call's checks and plans
    read, ``ops/quant.py``), through the plan kept with that choice; None: chosen and planned for this call alone."""
    args = (x, weights, activation, gated)

    def choice():
        return choose(Problem(x.device.type, x.dtype, x.reshape(-1, x.shape[-1]).shape[0], x.device.index,
                              cublas_format(weights), a8_format(weights)))
    if signature is None:
        impl = choice()
        plan = impl.plan(args) if impl.plan is not None else None
    else:
        impl, plan = core.kept_plan(_PLANS, (signature, config.fp8_w8a8, config.force_impl), choice, args, _MAX_PLANS)
    if plan is None:
        return impl.fn(x, weights, activation, gated)
    return plan(x, weights)


def describe(p: Problem) -> str:
    """Which implementation runs ``p``, and why each one above it does not."""
    return core.describe_first(FP8, p)
