"""The router top-k op's implementations (``mlp_fuser::moe_router_topk``: ``ops/router.py``) as rows of the one
dispatcher's table (``core``). Not timed: the Triton kernel (``kernels/router.py``) where it takes the shape, else
the aten ops; the choice is kept per key in ``core``'s cache, so a call costs one lookup.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from ..kernels import router as kernel
from ..reference import reference_router_topk
from . import core
from .core import Impl


class Problem(NamedTuple):
    device: str
    E: int
    k: int
    unit_stride: bool  # the logits' last stride is 1 (the kernel reads rows as they lie)


def _takes(p: Problem) -> str | None:
    return kernel.why_not(p.E, p.k) if p.unit_stride else "the logits' last dimension is strided"


IMPLS: list[Impl] = [  # from the top down, the first that can run a call runs it
    Impl("triton_router_topk", kernel.router_topk, frozenset({"cuda"}), None, triton=True, why=(_takes,)),
    Impl("reference", reference_router_topk, None, None),
]
ROUTER = core.Registry("router", IMPLS, None)


def choose(logits: Tensor, k: int) -> Impl:
    """The implementation for a call on 2-D ``logits`` with top ``k`` (a key of what the rows read that is cheap to
    build on the host: every call of the op looks it up)."""
    key = (logits.is_cuda, logits.is_cpu, logits.shape[1], k, logits.stride(-1) == 1)
    choice = core.cached(ROUTER, key)
    if choice is None:
        choice = core.choose(ROUTER, Problem(logits.device.type, *key[2:]), None, key)
    return choice.eager
