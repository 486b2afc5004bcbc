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
from ..reference import reference_mlp
from . import core
from .core import Impl


class Problem(NamedTuple):
    device: str  # x's device type
    dtype: torch.dtype
    M: int  # x's rows
    index: int | None = None  # x's CUDA device (its capability decides)

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


def _kernels_run(p: Problem) -> str | None:
    return why_not_kernels(p.device, p.index)


def _a8_on(p: Problem) -> str | None:
    return None if config.fp8_w8a8 else "mlp_fuser.config.fp8_w8a8 is off: the activations keep their dtype"


def _kernels(a8: bool):
    """The FP8 kernels (``kernels/fp8.py``): x quantized per token and 128 columns (``a8``) or as it is."""
    def run(x: Tensor, weights, activation, gated: bool) -> Tensor:
        lead, width = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, width)
        if len(weights) == 1:
            y = fp8_kernels.fp8_linear(x2, weights[0][1], bias=weights[0][2], a8=a8)
        else:
            (_, w1, b1), *rest = weights
            if gated:
                (_, wu, bu), (_, wd, bd) = rest
                if b1 is not None or bu is not None:  # biases before the product: in aten (rare on gated MLPs)
                    g = fp8_kernels.fp8_linear(x2, w1, bias=b1, a8=a8)
                    u = fp8_kernels.fp8_linear(x2, wu, bias=bu, a8=a8)
                    h = get_activation(activation).fn(g) * u
                else:
                    h = fp8_kernels.fp8_linear(x2, w1, wu, activation=activation, a8=a8)
            else:
                (_, wd, bd), = rest
                h = fp8_kernels.fp8_linear(x2, w1, bias=b1, activation=activation, a8=a8)
            y = fp8_kernels.fp8_linear(h, wd, bias=bd, a8=a8)
        return y.reshape(*lead, y.shape[-1])
    return run


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


IMPLS: list[Impl] = [  # from the top down, the first that can run a call runs it
    # x quantized per token and 128 columns, the fp8 tensor cores multiply: fastest
    Impl("fp8_w8a8", _kernels(True), None, None, why=(_kernels_run, _a8_on)),
    Impl("fp8_w8a16", _kernels(False), None, None, why=(_kernels_run,)),  # weights cast on chip, x as it is
    Impl("aten_dequantize", dequantized, None, None),  # each weight dequantized to x's dtype, then aten
]
FP8 = core.Registry("fp8", IMPLS, None)


def choose(p: Problem) -> Impl:
    return core.first(FP8, p)


def describe(p: Problem) -> str:
    """Which implementation runs ``p``, and why each one above it does not."""
    lines = []
    for impl in IMPLS:
        why = impl.why_not(p)
        if why is None:
            return "\n".join([*lines, f"{impl.name}: runs"])
        lines.append(f"{impl.name}: {why}")
    return "\n".join(lines)
