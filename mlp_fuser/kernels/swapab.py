"""h = act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up) for a few tokens, with the weight rows in the dot's M side.

At decode sizes (a few tokens) gate and up are a stream of 2·I·K weight bytes. ``gate_up_act`` puts the tokens in the
dot's M side, so at M = 16 its tiles run Ampere's mma.sync; here the roles swap ("swap-AB", as ``linear_splitk``
does for the down projection): each program owns BLOCK_N weight rows, all of K, and computes

    accᵀ_gate[BLOCK_N, BLOCK_M] = w_gate[n-block] @ x[m-block]ᵀ      (fp32; one x tile feeds both dots)
    accᵀ_up  [BLOCK_N, BLOCK_M] = w_up[n-block]   @ x[m-block]ᵀ

so a handful of tokens (BLOCK_M = 16) still fills Hopper's wgmma, and the weight loads need no mask along N
(rows past I repeat the last one and are never stored). The epilogue transposes the tile back and runs
``gate_up_finish`` (biases, act(gate) * up in fp32), so h is stored row-major with I contiguous.

Whole K per program, no split: every config that won the sweep had SPLIT_K = 1. Where the weight rows are too few
to fill the SMs the dispatcher, which times it against ``gate_up_act``, keeps the faster; it is a candidate up to
M = 32, past which ``triton_gemm`` or cuBLAS won (benchmarks/NOTES.md, swap-AB gate/up).
Like ``gate_up_act``, program 0 can zero a small int32 workspace of the next kernel (``linear_splitk``'s counters).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from ..activations import get_activation
from . import common
from .common import (
    INTERPRET,
    Launcher,
    aligned,
    cdiv,
    dot_precision,
    k_loop_bytes,
    k_loop_fits,
    next_power_of_2,
    stand_ins,
)
from .gemm import gate_up_finish, zero_workspace


@triton.jit
def _gate_up_act_swapab_kernel(
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, h_ptr, zero_ptr,
    M, N, K,
    n_zero,  # int32 elements at zero_ptr to set to 0 for the next kernel (split-K's counters); 0: none
    stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk, stride_bg, stride_bu,
    ACT: tl.constexpr, HAS_UP: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)  # a block of weight rows = columns of h
    pid_m = tl.program_id(1)  # a block of tokens
    if n_zero > 0:
        if pid_n == 0 and pid_m == 0:
            zero_workspace(zero_ptr, n_zero)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x and h
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of the weights
    rows = tl.minimum(offs_n, N - 1)  # rows past N repeat the last one: no mask along N (never stored)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M

    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + offs_k  # the K indices of this step
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=mask_m[:, None] & (kk[None, :] < K), other=0.0)
        wg = tl.load(wg_ptr + rows[:, None] * stride_wgn + kk[None, :] * stride_wgk, mask=kk[None, :] < K, other=0.0)
        acc_g = tl.dot(wg, x.T, acc_g, input_precision=PRECISION)
        if HAS_UP:
            wu = tl.load(wu_ptr + rows[:, None] * stride_wun + kk[None, :] * stride_wuk, mask=kk[None, :] < K,
                         other=0.0)
            acc_u = tl.dot(wu, x.T, acc_u, input_precision=PRECISION)

    # back to h's orientation (BLOCK_M, BLOCK_N): the shared epilogue, and a store along h's contiguous rows
    mask_n = offs_n < N
    h = gate_up_finish(tl.trans(acc_g), tl.trans(acc_u), bg_ptr, bu_ptr, offs_n, mask_n, stride_bg, stride_bu, ACT,
                       HAS_UP, HAS_BG, HAS_BU)
    h_ptrs = h_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@cache
def swapab_config(M: int, N: int, itemsize: int, device: torch.device,
                  n_weights: int = 2) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M tokens and N weight rows: 64 rows per program, and of
    BLOCK_K 128 or 64 (halved for fp32) with 3 or 4 stages, the one that keeps the most weight bytes in flight per
    SM: its pipeline's footprint (stages × one x tile and ``n_weights`` weight tiles: 2 gated, 1 plain) times the
    programs an SM runs at once (as many as fit in its shared memory, at most the programs per SM there are); the
    smaller footprint on a tie. A model fitted on timed configs of four gate/up shapes, not of every GPU
    (benchmarks/NOTES.md, swapab_config)."""
    if INTERPRET:
        return 16, 32, 32, 4, 1
    block_m, block_n = max(16, next_power_of_2(min(M, 64))), 64
    programs = cdiv(N, block_n) * cdiv(M, block_m)
    sms, per_sm_bytes = common.num_sms(device), common.smem_per_sm(device)
    options = []  # ((-bytes in flight per SM, footprint), config); BLOCK_K 64 with 3 stages fits at any M and dtype
    for block_k, stages in ((128, 3), (128, 4), (64, 3), (64, 4)):
        block_k = block_k * 2 // max(2, itemsize)
        if k_loop_fits(stages, block_m, block_k, block_n, n_weights, itemsize):
            smem = k_loop_bytes(stages, block_m, block_k, block_n, n_weights, itemsize)
            ctas = max(1, per_sm_bytes // (smem + 1024))  # the driver reserves 1 KiB per CTA
            options.append(((-min(ctas, cdiv(programs, sms)) * smem, smem), (block_m, block_n, block_k, 4, stages)))
    return min(options)[1]


_launch = Launcher(_gate_up_act_swapab_kernel)


def gate_up_act_swapab(x2: torch.Tensor, w_gate: torch.Tensor, b_gate: torch.Tensor | None, w_up: torch.Tensor | None,
                       b_up: torch.Tensor | None, activation: str, zero: torch.Tensor | None = None,
                       config=None) -> torch.Tensor:
    """``gate_up_act``'s contract (h (M, I) in x2's dtype; w_up None: no product; ``zero``: a contiguous int32 tensor
    set to 0 on the way), computed with the weight rows in the dot's M side: for few tokens."""
    act = get_activation(activation)
    M, K = x2.shape
    N = w_gate.shape[0]
    h = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        if zero is not None:
            zero.zero_()
        return h
    has_up, has_bg, has_bu = w_up is not None, b_gate is not None, b_up is not None
    BM, BN, BK, warps, stages = config or swapab_config(M, N, x2.element_size(), x2.device, 2 if has_up else 1)
    wu, bg, bu = stand_ins(w_gate, b_gate, w_up, b_up, h)
    (sxm, sxk), (sgn, sgk), (sun, suk) = x2.stride(), w_gate.stride(), wu.stride()
    sbg, sbu, precision = bg.stride(0), bu.stride(0), dot_precision(x2.dtype)
    n_zero = zero.numel() if zero is not None else 0
    key = (x2.get_device(), x2.dtype, M, N, K, sxm, sxk, sgn, sgk, sun, suk, sbg, sbu,
           aligned(x2, w_gate, bg, wu, bu, h), act.name, has_up, has_bg, has_bu, precision, n_zero, BM, BN, BK, warps,
           stages)
    _launch(
        key, (cdiv(N, BN), cdiv(M, BM)),
        x2, w_gate, bg, wu, bu, h, zero if zero is not None else h,
        M, N, K, n_zero,
        sxm, sxk, sgn, sgk, sun, suk, sbg, sbu,
        ACT=act.triton_fn, HAS_UP=has_up, HAS_BG=has_bg, HAS_BU=has_bu, PRECISION=precision,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps, num_stages=stages,
    )
    return h
