"""The MoE router's top-k as one op: ``mlp_fuser::moe_router_topk``.

    moe_router_topk(logits, k, renorm, out_dtype) -> (weights, ids)
    = softmax(logits, dim=-1, dtype=float32) → topk(k) → (÷ the k weights' sum where renorm) → weights.to(out_dtype)

what transformers' top-k routers compute after their GEMM (``Qwen3MoeTopKRouter`` and the families that copy it);
``patterns/router_topk.py`` finds that chain in a captured graph. logits (T, E) of any floating dtype; ids int64, in
descending order of weight, as ``torch.topk`` returns them. On CUDA (and under the Triton interpreter when
``config.triton_on_cpu``) one Triton kernel (``kernels/router.py``) where it takes the shape, the aten ops elsewhere.
No autograd: the graph pass leaves routers whose logits need gradients to aten.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import config
from ..kernels import router as kernel

_lib = torch.library.Library("mlp_fuser", "FRAGMENT")
_lib.define("moe_router_topk(Tensor logits, int k, bool renorm, ScalarType out_dtype) -> (Tensor, Tensor)")


def reference(logits: Tensor, k: int, renorm: bool, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The aten ops, exactly as the routers run them."""
    wts, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    if renorm:
        wts = wts / wts.sum(dim=-1, keepdim=True)
    return wts.to(out_dtype), ids


def _check(logits: Tensor, k: int) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"mlp_fuser.moe_router_topk: logits must be a 2-D floating tensor (tokens, experts); got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"mlp_fuser.moe_router_topk: k={k} outside 1..{logits.shape[1]} (the number of experts)")


def uses_kernel(logits: Tensor, k: int) -> bool:
    """Whether the Triton kernel computes this call (else the aten ops)."""
    on = logits.is_cuda or (config.triton_on_cpu and logits.is_cpu)
    return (on and config.force_impl != "reference" and logits.stride(-1) == 1
            and kernel.why_not(logits.shape[1], k) is None)


def _forward(logits: Tensor, k: int, renorm: bool, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    _check(logits, k)
    if torch.is_grad_enabled() and logits.requires_grad:
        raise ValueError("mlp_fuser.moe_router_topk has no backward: call it on logits that need no gradient")
    if uses_kernel(logits, k):
        return kernel.router_topk(logits, k, renorm, out_dtype)
    return reference(logits, k, renorm, out_dtype)


_lib.impl("moe_router_topk", _forward, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::moe_router_topk")
def _fake(logits, k, renorm, out_dtype):
    _check(logits, k)
    T = logits.shape[0]
    return logits.new_empty((T, k), dtype=out_dtype), logits.new_empty((T, k), dtype=torch.int64)


def moe_router_topk(logits: Tensor, k: int, renorm: bool = True, out_dtype: torch.dtype | None = None):
    """``torch.ops.mlp_fuser.moe_router_topk`` (``out_dtype`` defaults to the logits' dtype)."""
    return torch.ops.mlp_fuser.moe_router_topk.default(logits, k, renorm, out_dtype or logits.dtype)
