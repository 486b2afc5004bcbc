"""The one activation registry.

Each activation has a torch implementation (used by the CPU reference and by autograd), its derivative
(the aten backward needs f'), and Triton implementations of both (used inside the kernels' epilogues, the forward
GEMM's and the backward GEMM's, always on fp32 values). HF's names (``ACT2FN`` keys) map onto these through ALIASES.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # Triton is a runtime dependency, but keep the registry importable without it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

if TYPE_CHECKING:
    from triton import JITFunction

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@dataclass(frozen=True)
class Activation:
    name: str
    fn: Callable[[Tensor], Tensor]  # f(x), in x's dtype, as the unfused module computes it
    grad: Callable[[Tensor], Tensor]  # f'(x)
    triton_fn: JITFunction | None  # a @triton.jit function of one fp32 block (None without Triton)
    triton_grad: JITFunction | None  # f'(x) the same way


# ---- torch side -------------------------------------------------------------------------------


def _gelu_grad(x: Tensor) -> Tensor:
    cdf = 0.5 * (1.0 + torch.erf(x * _INV_SQRT_2))
    return cdf + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _gelu_tanh_grad(x: Tensor) -> Tensor:
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    t = torch.tanh(inner)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)


def _silu_grad(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _quick_gelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


def _quick_gelu_grad(x: Tensor) -> Tensor:
    s = torch.sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1.0 - s)


def _relu2(x: Tensor) -> Tensor:
    return torch.square(F.relu(x))


# ---- Triton side (fp32 in, fp32 out) ---------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _tanh(z):
        # tanh through exp, so the same code runs in the interpreter and on every GPU.
        e = tl.exp(-2.0 * tl.abs(z))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(z >= 0, t, -t)

    @triton.jit
    def gelu_triton(x):
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))

    @triton.jit
    def gelu_tanh_triton(x):
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + _tanh(inner))

    @triton.jit
    def silu_triton(x):
        return x * tl.sigmoid(x)

    @triton.jit
    def relu_triton(x):
        return tl.maximum(x, 0.0)

    @triton.jit
    def quick_gelu_triton(x):
        return x * tl.sigmoid(1.702 * x)

    @triton.jit
    def relu2_triton(x):
        r = tl.maximum(x, 0.0)
        return r * r

    # -- derivatives, f'(x) ------------------------------------------------------------------------

    @triton.jit
    def gelu_grad_triton(x):
        cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        return cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327  # Φ(x) + x·φ(x)

    @triton.jit
    def gelu_tanh_grad_triton(x):
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)

    @triton.jit
    def silu_grad_triton(x):
        s = tl.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))

    @triton.jit
    def relu_grad_triton(x):
        return tl.where(x > 0.0, 1.0, 0.0)

    @triton.jit
    def quick_gelu_grad_triton(x):
        s = tl.sigmoid(1.702 * x)
        return s + 1.702 * x * s * (1.0 - s)

    @triton.jit
    def relu2_grad_triton(x):
        return 2.0 * tl.maximum(x, 0.0)

else:  # pragma: no cover
    gelu_triton = gelu_tanh_triton = silu_triton = relu_triton = quick_gelu_triton = relu2_triton = None
    gelu_grad_triton = gelu_tanh_grad_triton = silu_grad_triton = relu_grad_triton = None
    quick_gelu_grad_triton = relu2_grad_triton = None


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("gelu", F.gelu, _gelu_grad, gelu_triton, gelu_grad_triton),
        Activation("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), _gelu_tanh_grad, gelu_tanh_triton,
                   gelu_tanh_grad_triton),
        Activation("silu", F.silu, _silu_grad, silu_triton, silu_grad_triton),
        Activation("relu", F.relu, lambda x: (x > 0).to(x.dtype), relu_triton, relu_grad_triton),
        Activation("quick_gelu", _quick_gelu, _quick_gelu_grad, quick_gelu_triton, quick_gelu_grad_triton),
        Activation("relu2", _relu2, lambda x: 2.0 * F.relu(x), relu2_triton, relu2_grad_triton),
    )
}

# Other spellings (HF ACT2FN keys and common names) of the same functions.
ALIASES: dict[str, str] = {
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python": "gelu",
    "swish": "silu",
    "quickgelu": "quick_gelu",
    "relu_squared": "relu2",
    "relu2": "relu2",
}


def get_activation(name: str) -> Activation:
    """Look an activation up by its name or an alias; unknown names raise ValueError listing the known ones."""
    if not isinstance(name, str):
        raise TypeError(f"mlp_fuser: activation must be a str, got {type(name).__name__}")
    key = ALIASES.get(name, name)
    if key not in ACTIVATIONS:
        known = sorted(set(ACTIVATIONS) | set(ALIASES))
        raise ValueError(f"mlp_fuser: unknown activation {name!r}; known: {', '.join(known)}")
    return ACTIVATIONS[key]
