"""h = act(g) * u, elementwise, in one launch: the glue of the cuBLAS path.

Algorithm: each program loads a block of g (and u), upcasts to fp32, applies the activation and the product in
fp32, and stores h in g's dtype. Two layouts of the same work:
  - flat (``_act_mul_flat_kernel``, when g and u are contiguous, as cuBLAS writes them): a 1-D grid over M·N
    elements, BLOCK of them per program, no row/column arithmetic and no ragged row ends: what Inductor
    generates for this pointwise op;
  - tiled (``_act_mul_kernel``, any strides): a 2-D grid of (BLOCK_M, BLOCK_N) tiles loaded through the strides.
Bytes moved: read g and u once, write h once: 3 · M · N · itemsize (2 · M · N · itemsize without u). h is
contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..activations import get_activation
from .common import Launcher, aligned, cdiv, next_power_of_2


@triton.jit
def _act_mul_kernel(
    g_ptr, u_ptr, h_ptr,
    M, N,
    stride_gm, stride_gn, stride_um, stride_un,
    ACT: tl.constexpr, HAS_U: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)

    g = tl.load(g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn, mask=mask, other=0.0)
    h = ACT(g.to(tl.float32))
    if HAS_U:
        u = tl.load(u_ptr + offs_m[:, None] * stride_um + offs_n[None, :] * stride_un, mask=mask, other=0.0)
        h = h * u.to(tl.float32)

    tl.store(h_ptr + offs_m[:, None] * N + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_mul_flat_kernel(g_ptr, u_ptr, h_ptr, n, ACT: tl.constexpr, HAS_U: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = ACT(tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    if HAS_U:
        h = h * tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


_launch_act_mul = Launcher(_act_mul_kernel)
_launch_act_mul_flat = Launcher(_act_mul_flat_kernel)
FLAT = dict(BLOCK=1024, num_warps=4)  # the flat kernel's launch: 8 bf16 elements (16 bytes) per thread


def act_mul(g: Tensor, u: Tensor | None, activation: str, *, flat: dict | None = None) -> Tensor:
    """``act(g) * u`` (or ``act(g)`` when ``u`` is None) computed in fp32, returned contiguous in g's dtype.

    ``flat`` overrides the flat kernel's BLOCK and num_warps (for sweeps)."""
    act = get_activation(activation)
    if g.dim() != 2 or (u is not None and u.shape != g.shape):
        raise ValueError(f"act_mul: g must be 2-D and u None or of g's shape; got {tuple(g.shape)}, "
                         f"{None if u is None else tuple(u.shape)}")
    M, N = g.shape
    h = torch.empty((M, N), dtype=g.dtype, device=g.device)
    if h.numel() == 0:
        return h
    uu = u if u is not None else g  # a valid pointer, never read
    key = (g.get_device(), g.dtype, M, N, aligned(g, uu), act.name, u is not None)
    if g.is_contiguous() and (u is None or u.is_contiguous()):
        launch = FLAT if flat is None else {**FLAT, **flat}
        grid = (cdiv(h.numel(), launch["BLOCK"]),)
        _launch_act_mul_flat((*key, *launch.items()), grid,
                             g, uu, h, h.numel(), ACT=act.triton_fn, HAS_U=u is not None, **launch)
        return h
    # One row of up to 1024 columns per program when N is wide; several short rows when it is narrow.
    BLOCK_N = min(next_power_of_2(N), 1024)
    BLOCK_M = min(max(1024 // BLOCK_N, 1), next_power_of_2(M))
    grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
    (sgm, sgn), (sum_, sun) = g.stride(), uu.stride()
    _launch_act_mul(
        (*key, sgm, sgn, sum_, sun), grid,
        g, uu, h, M, N,
        sgm, sgn, sum_, sun,
        ACT=act.triton_fn, HAS_U=u is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4,
    )
    return h
