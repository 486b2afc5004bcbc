"""Split-K GEMMs for few rows, each streaming its weights once: y = h @ wᵀ + b (the down projection) and
h = act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up) (gate and up, ``gate_up_act_splitk``).

At small M a GEMM is a stream of weight bytes: with one program per output tile, a (M, 4096) output in
64-wide tiles gives 64 programs, too few to pull the full bandwidth of 132 SMs. So the reduction
dimension K is split in SPLIT_K ranges; each program owns one (output tile, K range) pair:

    accᵀ[BLOCK_N, BLOCK_M] = w[n-block, k-range] @ h[m-block, k-range]ᵀ       (fp32, "swap-AB")
    partials[split, m-block, n-block] = acc                                   (plain store, fp32)
    the last of the SPLIT_K programs of a tile (an atomic counter per tile says which) sums the
    partials in split order, adds the bias, casts and stores y.

The down projection's weight rows take the dot's M side, so a handful of tokens (BLOCK_M = 16) still runs Hopper's
wgmma, and its loads need no mask along N. Against h in the M side (run 33, H200 bf16, w_down 4096 x 11008): M = 16
26.8 against 31.2 µs, M = 128 52.6 against 69.3; cuBLAS 29.1 and 31.8.

One GEMM launch, and the sum order is fixed, so results are deterministic. The gate/up kernel is the same schedule
with two weights: its partials are gate's and up's, and the last program of a tile runs gate_up_act's epilogue
(biases, act(gate) * up) on their sums. The workspace (partials and
counters) is allocated per call; the counters must be zero: a memset launch, unless the caller had the kernel
before (gate_up_act) zero them (``splitk_counters``).
Extra bytes: SPLIT_K · M · N · 4 written and read, small next to w at small M.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from ..activations import get_activation
from .common import (
    INTERPRET,
    Launcher,
    aligned,
    cdiv,
    dot_precision,
    k_loop_bytes,
    k_loop_fits,
    next_power_of_2,
    num_sms,
    stand_ins,
)
from .gemm import gate_up_acc, gate_up_finish


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
    ranges no shorter than two BLOCK_Ks. From the sweep of run 33 (``benchmarks/probe_down_tma.py``, H200, bf16 and
    fp16, M = 1-128): 64-row weight tiles, BLOCK_K = 128, 3 stages, 4 warps were the fastest plain-load config on
    every shape and M."""
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


# ---- gate and up, split over K ------------------------------------------------------------------------------


@triton.jit
def _gate_up_act_splitk_kernel(
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, h_ptr, partials_ptr, counters_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk, stride_bg, stride_bu,
    ACT: tl.constexpr, HAS_UP: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)  # the tile of h, row-major over (M blocks, N blocks)
    split = tl.program_id(1)  # the K range
    num_pid_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tile // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x and h
    offs_n = (tile % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of the weights = columns of h
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_lo = split * K_PER_SPLIT
    acc_g, acc_u = gate_up_acc(
        x_ptr + k_lo * stride_xk, wg_ptr + k_lo * stride_wgk, wu_ptr + k_lo * stride_wuk,
        offs_m, offs_n, mask_m, mask_n, tl.minimum(K_PER_SPLIT, K - k_lo),
        stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk,
        HAS_UP, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )
    mask = mask_m[:, None] & mask_n[None, :]
    h_ptrs = h_ptr + offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        h = gate_up_finish(acc_g, acc_u, bg_ptr, bu_ptr, offs_n, mask_n, stride_bg, stride_bu, ACT, HAS_UP, HAS_BG,
                           HAS_BU)
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask)
    else:
        # partials are laid out [split, gate or up, M, N], contiguous, fp32
        partial_ptrs = partials_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(partial_ptrs + (2 * split) * M * N, acc_g, mask=mask)
        if HAS_UP:
            tl.store(partial_ptrs + (2 * split + 1) * M * N, acc_u, mask=mask)
        tl.debug_barrier()  # every thread's partials are issued before the counter moves
        done = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:  # the last program of this tile: sum in split order, then gate_up_act's epilogue
            g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                g += tl.load(partial_ptrs + (2 * s) * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_UP:
                    u += tl.load(partial_ptrs + (2 * s + 1) * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            h = gate_up_finish(g, u, bg_ptr, bu_ptr, offs_n, mask_n, stride_bg, stride_bu, ACT, HAS_UP, HAS_BG,
                               HAS_BU)
            tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask)


@cache
def gate_up_splitk_config(M: int, N: int, K: int, itemsize: int, device: torch.device) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for gate/up at this shape: the split that fills
    the SMs' program slots in the fewest, fullest waves, each K range at least 4 BLOCK_Ks, at most 16 splits, and
    the fp32 partials (2 · SPLIT_K · M · N · 4 bytes, written and read back) counted against the weight bytes."""
    if INTERPRET:
        return 16, 32, 32, min(3, cdiv(K, 32)), 4, 1
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n, block_k = 64, (128 if itemsize <= 2 else 32)
    stages = 4 if k_loop_fits(4, block_m, block_k, block_n, 2, itemsize) else 2
    smem = k_loop_bytes(stages, block_m, block_k, block_n, 2, itemsize)
    slots = num_sms(device) * max(1, min(4, (220 * 1024) // smem))  # programs resident at once
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    weight_bytes = 2 * N * K * itemsize

    def cost(split):  # in units of one whole tile's weight stream on one program slot
        waves = cdiv(tiles * split, slots)
        return waves / split * (1 + 2 * 2 * split * M * N * 4 / weight_bytes)

    splits = range(1, max(1, min(16, K // (4 * block_k))) + 1)
    split = min(splits, key=lambda s: (cost(s), s))
    return block_m, block_n, block_k, split, 4, stages


_launch_gate_up_act_splitk = Launcher(_gate_up_act_splitk_kernel)


def gate_up_act_splitk(x2: torch.Tensor, w_gate: torch.Tensor, b_gate: torch.Tensor | None, w_up: torch.Tensor | None,
                       b_up: torch.Tensor | None, activation: str, config=None) -> torch.Tensor:
    """``gate_up_act``'s contract (h (M, I) in x2's dtype; w_up None: no product), as a split-K GEMM: for few rows,
    where whole tiles are too few to keep every SM streaming weights."""
    act = get_activation(activation)
    M, K = x2.shape
    N = w_gate.shape[0]
    h = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return h
    BM, BN, BK, split, warps, stages = config or gate_up_splitk_config(M, N, K, x2.element_size(), x2.device)
    k_per_split, split, tiles = _plan(M, N, K, (BM, BN, BK, split))
    has_up, has_bg, has_bu = w_up is not None, b_gate is not None, b_up is not None
    # the call's own workspace (see linear_splitk): partials, and arrival counters that must start at 0
    if split > 1:
        parts = torch.empty(2 * split * M * N, device=x2.device, dtype=torch.float32)
        counters = torch.zeros(tiles, device=x2.device, dtype=torch.int32)
    else:  # never read: any valid pointers
        parts = counters = h
    wu, bg, bu = stand_ins(w_gate, b_gate, w_up, b_up, h)
    (sxm, sxk), (sgn, sgk), (sun, suk) = x2.stride(), w_gate.stride(), wu.stride()
    sbg, sbu, precision = bg.stride(0), bu.stride(0), dot_precision(x2.dtype)
    key = (x2.get_device(), x2.dtype, M, N, K, k_per_split, sxm, sxk, sgn, sgk, sun, suk, sbg, sbu,
           aligned(x2, w_gate, bg, wu, bu, h), act.name, has_up, has_bg, has_bu, precision, split, BM, BN, BK, warps,
           stages)
    _launch_gate_up_act_splitk(
        key, (tiles, split),
        x2, w_gate, bg, wu, bu, h, parts, counters,
        M, N, K, k_per_split,
        sxm, sxk, sgn, sgk, sun, suk, sbg, sbu,
        ACT=act.triton_fn, HAS_UP=has_up, HAS_BG=has_bg, HAS_BU=has_bu, PRECISION=precision,
        SPLIT_K=split, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps, num_stages=stages,
    )
    return h
