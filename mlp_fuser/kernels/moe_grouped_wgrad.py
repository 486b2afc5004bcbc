"""The experts' weight gradients, and dx, by torch's grouped GEMM (``torch._grouped_mm``, CUTLASS on sm90) in place of
``moe_backward``'s Triton wgrad kernel and its dx by the down kernel; the act kernel is unchanged.

grouped_mm reads each expert's rows as one contiguous run (int32 ends ``offs``) and gathers nothing, so its operands
are stored in the *compact* sorted order: the routing's order (``Routing``: runs padded to BLOCK_M) with the padding
squeezed out, row = padded position − shift[e] (expert e's padded start minus its compact start). The act kernel
writes h and a second copy of [dg du] there (``SORTED``); ``sorted_rows`` gathers x and w_p·dy. Then
dWd[e] = Σ_p (w_p dy_p)ᵀ h_p and dWgu[e] = Σ_p [dg du]_pᵀ x_p as grouped_mm(Aᵀ, B) with A column-major and B
row-major: the one layout torch's kernel takes empty experts in (an offset repeated) and checks no run's alignment.
Rows past offs[-1] (dropped pairs) are never read. Bias gradients are summed as the Triton wgrad sums them (fp32;
w·dy unrounded, [dg du] as stored): per-block column sums by the kernels, added per expert.

dx (``grouped_dx``): dx_p = [dg du]_p Wgu[e] as grouped_mm(A, B), A the compact copy (S, 2I) row-major and B Wgu
(E, 2I, H) as stored (rows or columns contiguous), the 2-D x 3-D form autograd of grouped_mm uses: an empty expert is
an offset repeated, no run's alignment is checked, rows past offs[-1] are never read. Each pair's
product comes back in x's dtype (grouped_mm's output is its inputs'), each token's k rows are summed in fp32 in j
order as ``moe_combine`` sums them, found through the act kernel's map of each pair's compact row; a dropped pair's
row is never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import compat
from .common import INTERPRET, cdiv, launch
from .moe import moe_combine
from .moe_routing import Routing

__all__ = ["why_not", "compact_offsets", "sorted_rows", "grouped_wgrad", "per_expert", "grouped_dx"]

MAX_GROUPS = 1024  # torch's CUTLASS grouped GEMM takes fewer groups than this
ROWS_CONFIG = {"BLOCK_N": 32, "num_warps": 4} if INTERPRET else {"BLOCK_N": 128, "num_warps": 4}


def why_not(device: torch.device, dtype: torch.dtype, E: int, H: int, I: int, w_gu: Tensor | None = None
            ) -> str | None:
    """Why the weight gradients (or, given the weight ``w_gu`` it reads, dx) cannot go through grouped_mm here
    (None: they can, without a host sync)."""
    if compat.grouped_mm is None:
        return "torch has no grouped_mm"
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (H * itemsize) % 16 or (I * itemsize) % 16:
        return f"H {H} and I {I} must be multiples of {16 // itemsize} (grouped_mm's strides: 16 bytes)"
    if w_gu is not None and (w_gu.data_ptr() % 16 or 1 not in w_gu.stride()[1:]):
        return f"w_gate_up (strides {w_gu.stride()}) is not 16-byte aligned with its rows or columns contiguous"
    if device.type != "cuda":
        return None
    if torch.version.hip is not None:
        return "ROCm: torch's grouped GEMM there is not the CUTLASS one this row was made for"
    if dtype != torch.bfloat16:
        return f"dtype {dtype}: torch's CUTLASS grouped GEMM is bfloat16 only (else a host sync and a GEMM per expert)"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"sm_{major}{minor}: sm90 only (sm100's grouped GEMM gives empty experts non-zero gradients, "
                "pytorch#172439; older GPUs: a host sync and a GEMM per expert)")
    if E >= MAX_GROUPS:
        return f"{E} experts: torch's grouped GEMM takes fewer than {MAX_GROUPS} groups"
    return None


@triton.jit
def compact_rows(pid_b, e, shift_ptr, BLOCK_M: tl.constexpr):
    """The compact sorted rows of block ``pid_b``'s pairs (its padding rows get rows of the next run: mask them)."""
    return (pid_b * BLOCK_M + tl.arange(0, BLOCK_M) - tl.load(shift_ptr + e)).to(tl.int64)


@triton.jit
def _sorted_rows_kernel(
    src_ptr, wts_ptr, dst_ptr, sums_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr, shift_ptr,
    S, K_TOP, N, stride_sm, stride_sn, stride_wt, stride_wj,
    SCALED: tl.constexpr, SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # -- dst[row of pair p] = s_p · src[p // k] over BLOCK_N columns, for one block of one expert's pairs --------
    pid_b = tl.program_id(0)
    if pid_b >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + pid_b)
    pairs = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < S
    tokens = pairs // K_TOP
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    v = tl.load(src_ptr + tokens[:, None].to(tl.int64) * stride_sm + offs_n[None, :] * stride_sn, mask=mask,
                other=0.0)
    if SCALED:  # fp32 product, rounded once (the Triton wgrad so scales h_p, the other operand)
        s = tl.load(wts_ptr + tokens * stride_wt + (pairs % K_TOP) * stride_wj, mask=mask_m, other=0.0)
        v_f = v.to(tl.float32) * s.to(tl.float32)[:, None]
        v = v_f.to(dst_ptr.dtype.element_ty)
    else:
        v_f = v.to(tl.float32)
    rows = compact_rows(pid_b, e, shift_ptr, BLOCK_M)
    tl.store(dst_ptr + rows[:, None] * N + offs_n[None, :], v.to(dst_ptr.dtype.element_ty), mask=mask)
    if SUMS:  # this block's fp32 column sums: a bias gradient's share
        tl.store(sums_ptr + pid_b * N + offs_n, tl.sum(tl.where(mask, v_f, 0.0), axis=0), mask=offs_n < N)


def compact_offsets(ids: Tensor, routing: Routing, expert_start: Tensor, E: int) -> tuple[Tensor, Tensor]:
    """(offs, shift), int32 (E,), on the device: each expert's compact run ends (grouped_mm's offsets) and the shift
    from the routing's padded rows to compact ones (``expert_start``: each expert's first block, E + 1 of them)."""
    flat = ids.reshape(-1)
    expert = torch.where((flat >= 0) & (flat < E), flat, E).long()  # dropped pairs, as moe_align drops them
    counts = torch.zeros(E + 1, dtype=torch.int32, device=ids.device)
    counts = counts.scatter_add_(0, expert, torch.ones_like(expert, dtype=torch.int32))[:E]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return offs, expert_start[:E] * routing.block_m - (offs - counts)


def sorted_rows(src: Tensor, wts: Tensor | None, routing: Routing, shift: Tensor, sums: bool = False
                ) -> tuple[Tensor, Tensor | None]:
    """(rows, block sums): rows (S, N) in compact sorted order, row of pair p = src[p // k] (T, N), times w_p where
    ``wts`` is given; rows past the valid pairs unwritten. With ``sums`` each block's fp32 column sums (blocks, N),
    unwritten past the used blocks."""
    T, N = src.shape
    S = T * routing.k
    rows = torch.empty((S, N), dtype=src.dtype, device=src.device)
    n_blocks = routing.block_expert.shape[0]
    part = torch.empty((n_blocks, N), dtype=torch.float32, device=src.device) if sums else None
    if n_blocks == 0 or N == 0:
        return rows, part
    w = wts if wts is not None else src
    launch(_sorted_rows_kernel, (n_blocks, cdiv(N, ROWS_CONFIG["BLOCK_N"])),
           src, w, rows, part if sums else rows, routing.sorted_pairs, routing.block_expert, routing.num_blocks,
           shift, S, routing.k, N, src.stride(0), src.stride(1), w.stride(0), w.stride(-1),
           SCALED=wts is not None, SUMS=sums, BLOCK_M=routing.block_m, **ROWS_CONFIG)
    return rows, part


def grouped_wgrad(a: Tensor, b: Tensor, offs: Tensor, dtype: torch.dtype, like: Tensor | None = None) -> Tensor:
    """dW (E, N, K): dW[e] = a[run e]ᵀ b[run e] for a (S, N) and b (S, K) in compact sorted order, in ``dtype``;
    where ``like`` (the weight) is an (E, K, N) tensor seen transposed, computed as (bᵀ a)ᵀ in its layout."""
    if like is not None and like.stride(1) == 1 and like.stride(2) != 1:
        return compat.grouped_mm(b.t(), a, offs=offs).to(dtype).transpose(1, 2)
    return compat.grouped_mm(a.t(), b, offs=offs).to(dtype)


def per_expert(part: Tensor, routing: Routing, E: int, like: Tensor) -> Tensor:
    """Block sums (blocks, N) added per expert, in ``like``'s dtype and shape (blocks past the used ones, and their
    unwritten rows, go to a bin that is dropped)."""
    out = torch.zeros((E + 1, part.shape[1]), dtype=torch.float32, device=part.device)
    return out.index_add_(0, routing.block_expert, part)[:E].to(like.dtype).reshape(like.shape)


def grouped_dx(dgu_s: Tensor, w_gu: Tensor, offs: Tensor, crow: Tensor, ids: Tensor, E: int) -> Tensor:
    """dx (T, H) in dgu_s's dtype: dx[t] = Σ_j [dg du]_p Wgu[e] over token t's valid pairs p = t·k + j, from the
    compact sorted copy ``dgu_s`` (S, 2I or I), its runs' ends ``offs`` and each pair's row there ``crow`` (S,)."""
    out = compat.grouped_mm(dgu_s, w_gu, offs=offs)  # (S, H): rows past offs[-1] unwritten, never read
    return moe_combine(out, ids, E, dgu_s.dtype, rows=crow)
