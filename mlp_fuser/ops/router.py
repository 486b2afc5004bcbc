"""The MoE router's top-k as one op: ``mlp_fuser::moe_router_topk``.

    moe_router_topk(logits, k, renorm, out_dtype) -> (weights, ids)
    = softmax(logits, dim=-1, dtype=float32) → topk(k) → (÷ the k weights' sum where renorm) → weights.to(out_dtype)

what transformers' top-k routers compute after their GEMM (``Qwen3MoeTopKRouter`` and the families that copy it);
``patterns/router_topk.py`` finds that chain in a captured graph. logits (T, E) of any floating dtype; ids int64, in
descending order of weight, as ``torch.topk`` returns them. On CUDA (and under the Triton interpreter when
``config.triton_on_cpu``) one Triton kernel (``kernels/router.py``) where it takes the shape, the aten ops elsewhere
(the rows of ``dispatch/router.py``).
No autograd: the graph pass leaves routers whose logits need gradients to aten.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import router
from ..reference import reference_router_topk as reference  # noqa: F401  (the op's aten ops, as tests name them)

_lib = torch.library.Library("mlp_fuser", "FRAGMENT")
_lib.define("moe_router_topk(Tensor logits, int k, bool renorm, ScalarType out_dtype) -> (Tensor, Tensor)")


def _check(logits: Tensor, k: int) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"mlp_fuser.moe_router_topk: logits must be a 2-D floating tensor (tokens, experts); got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"mlp_fuser.moe_router_topk: k={k} outside 1..{logits.shape[1]} (the number of experts)")


def uses_kernel(logits: Tensor, k: int) -> bool:
    """Whether the Triton kernel computes this call (else the aten ops)."""
    return router.choose(logits, k).name != "reference"


def _forward(logits: Tensor, k: int, renorm: bool, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    _check(logits, k)
    if torch.is_grad_enabled() and logits.requires_grad:
        raise ValueError("mlp_fuser.moe_router_topk has no backward: call it on logits that need no gradient")
    return router.choose(logits, k).fn(logits, k, renorm, out_dtype)


_lib.impl("moe_router_topk", _forward, "CompositeExplicitAutograd")


@torch.library.register_fake("mlp_fuser::moe_router_topk")
def _fake(logits, k, renorm, out_dtype):
    _check(logits, k)
    T = logits.shape[0]
    return logits.new_empty((T, k), dtype=out_dtype), logits.new_empty((T, k), dtype=torch.int64)


def moe_router_topk(logits: Tensor, k: int, renorm: bool = True, out_dtype: torch.dtype | None = None):
    """``torch.ops.mlp_fuser.moe_router_topk`` (``out_dtype`` defaults to the logits' dtype)."""
    return torch.ops.mlp_fuser.moe_router_topk.default(logits, k, renorm, out_dtype or logits.dtype)
