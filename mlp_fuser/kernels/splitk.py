"""A split-K GEMM for few rows, streaming its weight once: y = h @ wᵀ + b (the down projection).

At small M a GEMM is a stream of weight bytes: with one program per output tile, a (M, 4096) output in
64-wide tiles gives 64 programs, too few to pull the full bandwidth of 132 SMs. So the reduction
dimension K is split in SPLIT_K ranges; each program owns one (output tile, K range) pair:

    accᵀ[BLOCK_N, BLOCK_M] = w[n-block, k-range] @ h[m-block, k-range]ᵀ       (fp32, "swap-AB")
    partials[split, m-block, n-block] = acc                                   (plain store, fp32)
    the last of the SPLIT_K programs of a tile (an atomic counter per tile says which) sums the
    partials in split order, adds the bias, casts and stores y.

The down projection's weight rows take the dot's M side, so a handful of tokens (BLOCK_M = 16) still runs Hopper's
wgmma, and its loads need no mask along N; it beat h in the M side at M = 16-128 (benchmarks/NOTES.md, split-K down).

One GEMM launch, and the sum order is fixed, so results are deterministic. The workspace (partials and
counters) is allocated per call; the counters must be zero: a memset launch, unless the caller had the kernel
before (gate_up_act) zero them (``splitk_counters``).
Extra bytes: SPLIT_K · M · N · 4 written and read, small next to w at small M.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from .common import (
    INTERPRET,
    Launcher,
    aligned,
    cdiv,
    dot_precision,
    next_power_of_2,
    num_sms,
)


@triton.jit
def _linear_splitk_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, partials_ptr, counters_ptr,
    M, N, K, K_PER_SPLIT,
    stride_hm, stride_hk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)  # the output tile, row-major over (M blocks, N blocks)
    split = tl.program_id(1)  # the K range
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = tile // num_pid_n
    pid_n = tile % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of h and y
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of w = columns of y
    w_rows = tl.minimum(offs_n, N - 1)  # rows past N repeat the last one: no mask along N (those are not stored)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)

    # Swap-AB: the weight rows take the dot's M side (acc is yᵀ's tile), so few tokens still fill Hopper's wgmma
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        kk = k + offs_k  # the K indices of this step
        w = tl.load(w_ptr + w_rows[:, None] * stride_wn + kk[None, :] * stride_wk, mask=kk[None, :] < k_hi, other=0.0)
        h = tl.load(h_ptr + offs_m[:, None] * stride_hm + kk[None, :] * stride_hk,
                    mask=(offs_m[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
        acc = tl.dot(w, h.T, acc, input_precision=PRECISION)

    mask_y = (offs_n[:, None] < N) & (offs_m[None, :] < M)  # the tile's valid elements, in y and in the partials
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None] * stride_yn
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_y)
    else:
        # partials are laid out [split, M, N], contiguous
        partial_ptrs = partials_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(partial_ptrs + split * M * N, acc, mask=mask_y)
        tl.debug_barrier()  # every thread's partial is issued before the counter moves
        done = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:  # the last program of this tile: reduce in split order
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(partial_ptrs + s * M * N, mask=mask_y, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask_y)


@cache
def splitk_config(M: int, N: int, K: int, itemsize: int, device: torch.device) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for this shape: about two programs per SM, K
    ranges no shorter than two BLOCK_Ks; 64-row weight tiles, BLOCK_K = 128, 3 stages, 4 warps were the fastest
    plain-load config on every swept shape and M (benchmarks/NOTES.md, split-K down)."""
    if INTERPRET:
        return 16, 32, 32, min(3, cdiv(K, 32)), 4, 1
    block_m = max(16, next_power_of_2(min(M, 128)))
    block_n, block_k, stages = 64, 128 if itemsize <= 2 else 64, 3
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    split = max(1, min(cdiv(2 * num_sms(device), tiles), cdiv(K, 2 * block_k), 16))
    return block_m, block_n, block_k, split, 4, stages


_launch_linear_splitk = Launcher(_linear_splitk_kernel)


@cache
def _plan(M: int, N: int, K: int, config: tuple) -> tuple[int, int, int]:
    """(K per split, number of splits, output tiles) for a config."""
    BM, BN, BK, split = config[:4]
    k_per_split = cdiv(cdiv(K, split), BK) * BK
    return k_per_split, cdiv(K, k_per_split), cdiv(M, BM) * cdiv(N, BN)


def splitk_counters(M: int, N: int, K: int, config: tuple, device: torch.device) -> torch.Tensor | None:
    """The arrival counters ``linear_splitk`` will need for this shape and config (uninitialised: for a kernel that
    runs before it to zero), or None when the config does not split K."""
    _, split, tiles = _plan(M, N, K, config)
    return torch.empty(tiles, device=device, dtype=torch.int32) if split > 1 else None


def linear_splitk(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, config=None,
                  out: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """``h @ w.T + b`` for 2-D h (M, K) and w (N, K), any strides; y (or ``out``, (M, N)) in h's dtype.
    ``counters``: from ``splitk_counters``, zeroed since (else this call zeroes its own)."""
    M, K = h.shape
    N = w.shape[0]
    y = torch.empty((M, N), device=h.device, dtype=h.dtype) if out is None else out
    if M == 0:
        return y
    config = config or splitk_config(M, N, K, h.element_size(), h.device)
    BM, BN, BK, _, warps, stages = config
    k_per_split, split, tiles = _plan(M, N, K, config)
    if split > 1:
        parts = torch.empty(split * M * N, device=h.device, dtype=torch.float32)
        # Arrival counters, zeroed per call: a workspace of the call's own, so the op holds no tensor between calls
        # (a CUDA-graph pool must not see one outlive a warm-up) and concurrent streams never share one.
        if counters is None:
            counters = torch.zeros(tiles, device=h.device, dtype=torch.int32)
    else:  # never read: any valid pointers
        parts = counters = y
    bb = b if b is not None else h
    (shm, shk), (swn, swk), (sym, syn) = h.stride(), w.stride(), y.stride()
    precision = dot_precision(h.dtype)
    key = (h.get_device(), h.dtype, M, N, K, k_per_split, shm, shk, swn, swk, sym, syn, aligned(h, w, bb, y),
           b is not None, split, precision, BM, BN, BK, warps, stages)
    _launch_linear_splitk(
        key, (tiles, split),
        h, w, bb, y, parts, counters,
        M, N, K, k_per_split,
        shm, shk, swn, swk, sym, syn,
        HAS_BIAS=b is not None, SPLIT_K=split, PRECISION=precision,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps, num_stages=stages,
    )
    return y
