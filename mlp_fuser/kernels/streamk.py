"""h = act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up) as a stream-K GEMM: every SM gets the same share of work.

Why: for M = 16-256 the gate/up GEMM is a stream of weight bytes (2·I·K), and it runs near the copy bandwidth only
while every SM streams. With whole tiles per program, the tiles rarely divide evenly over the SMs: I = 11008 in
64-wide tiles at BLOCK_M = 128 is 172 tiles on 132 SMs, 1.3 waves, and the last 0.3 wave leaves most SMs idle.

Algorithm (stream-K): the work is a flat list of units, one unit = one BLOCK_K step of one (BLOCK_M, BLOCK_N) tile
of h, tile by tile (m-blocks of one weight panel adjacent, K innermost). The grid is persistent, a few programs
per SM, and program p takes the ITERS consecutive units [p·ITERS, (p+1)·ITERS): whole tiles in its middle, a
piece of a tile at either end. For each tile it touches it accumulates gate and up over its K steps in fp32; a
whole tile is finished at once (bias, act·up, store h). A piece is stored as an fp32 partial (gate and up) in a
workspace slot of its own, then an arrival counter per tile (acq_rel) tells the last of the tile's programs to
sum the tile's partials in K order, finish it and store h: no spinning, a fixed sum order (deterministic).
Even programs walk their tiles forwards, odd ones backwards: two neighbours then reach the tile they share at the
same time (both at the start of their range, or both at the end), so a partial is read soon after it is written,
from L2.

Bytes: the weights once (2·I·K), x once per tile (from L2), h (M·I), plus at most two partial tiles per program:
2 · grid · 2·BLOCK_M·BLOCK_N · 4 written and read (M=128, 132 programs, 128x64 tiles: 17 MB, L2-resident).
Workspace (partials and counters) is allocated per call; the counters are zeroed per call (one memset).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..activations import get_activation
from .common import INTERPRET, Launcher, aligned, cdiv, dot_precision, k_loop_fits, num_sms, stand_ins


@triton.jit
def _finish_tile(acc_g, acc_u, bg_ptr, bu_ptr, h_ptr, offs_m, offs_n, M, N, stride_bg, stride_bu,
                 ACT: tl.constexpr, HAS_UP: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr):
    """h[offs_m, offs_n] = act(acc_g + b_gate) * (acc_u + b_up), in fp32, rounded once at the store."""
    mask_n = offs_n < N
    if HAS_BG:
        acc_g += tl.load(bg_ptr + offs_n * stride_bg, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    h = ACT(acc_g)
    if HAS_UP:
        if HAS_BU:
            acc_u += tl.load(bu_ptr + offs_n * stride_bu, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        h = h * acc_u
    h_ptrs = h_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & mask_n[None, :])


@triton.jit
def _gate_up_act_streamk_kernel(
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, h_ptr, partials_ptr, counters_ptr,
    M, N, K, ITERS, MAX_PARTS,
    stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk, stride_bg, stride_bu,
    ACT: tl.constexpr, HAS_UP: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    k_iters = tl.cdiv(K, BLOCK_K)  # units per tile
    total = num_pid_m * tl.cdiv(N, BLOCK_N) * k_iters
    start = pid * ITERS  # this program's units: [start, end)
    end = tl.minimum(start + ITERS, total)
    first_tile = start // k_iters
    n_tiles = tl.cdiv(end, k_iters) - first_tile
    offs_k = tl.arange(0, BLOCK_K)
    tile_elems = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # a partial's layout

    for i in range(0, n_tiles):
        tile = first_tile + i + (pid % 2) * (n_tiles - 1 - 2 * i)  # odd programs walk their tiles backwards
        k_first = tl.maximum(start, tile * k_iters) - tile * k_iters  # this program's K steps of the tile
        k_last = tl.minimum(end, (tile + 1) * k_iters) - tile * k_iters
        pid_m = tile % num_pid_m  # the m-blocks of one weight panel are adjacent units
        pid_n = tile // num_pid_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x and h
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of the weights = columns of h
        mask_m = offs_m < M
        mask_n = offs_n < N

        # -- gate and up over K steps [k_first, k_last), one x tile feeding both dots ----------------------
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_first * BLOCK_K + offs_k[None, :]) * stride_xk
        wg_ptrs = wg_ptr + (k_first * BLOCK_K + offs_k[:, None]) * stride_wgk + offs_n[None, :] * stride_wgn
        wu_ptrs = wu_ptr + (k_first * BLOCK_K + offs_k[:, None]) * stride_wuk + offs_n[None, :] * stride_wun
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_first, k_last):
            k_left = K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            w_mask = (offs_k[:, None] < k_left) & mask_n[None, :]
            acc_g = tl.dot(x, tl.load(wg_ptrs, mask=w_mask, other=0.0), acc_g, input_precision=PRECISION)
            if HAS_UP:
                acc_u = tl.dot(x, tl.load(wu_ptrs, mask=w_mask, other=0.0), acc_u, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            wg_ptrs += BLOCK_K * stride_wgk
            wu_ptrs += BLOCK_K * stride_wuk

        if (k_first == 0) & (k_last == k_iters):  # the whole tile: finish it here
            _finish_tile(acc_g, acc_u, bg_ptr, bu_ptr, h_ptr, offs_m, offs_n, M, N, stride_bg, stride_bu,
                         ACT, HAS_UP, HAS_BG, HAS_BU)
        else:
            # -- a piece: store the partial in slot (tile, part), part = the piece's order along K ----------
            first_prog = (tile * k_iters) // ITERS  # the programs that share this tile: first_prog..last_prog
            last_prog = ((tile + 1) * k_iters - 1) // ITERS
            slot_ptr = partials_ptr + (tile * MAX_PARTS + pid - first_prog) * (2 * BLOCK_M * BLOCK_N)
            tl.store(slot_ptr + tile_elems, acc_g)
            if HAS_UP:
                tl.store(slot_ptr + BLOCK_M * BLOCK_N + tile_elems, acc_u)
            tl.debug_barrier()  # every thread's partial is issued before the counter moves
            arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
            if arrived == last_prog - first_prog:  # the last of the tile's programs: sum in K order, finish
                acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for part in range(0, last_prog - first_prog + 1):
                    part_ptr = partials_ptr + (tile * MAX_PARTS + part) * (2 * BLOCK_M * BLOCK_N)
                    acc_g += tl.load(part_ptr + tile_elems, cache_modifier=".cg")
                    if HAS_UP:
                        acc_u += tl.load(part_ptr + BLOCK_M * BLOCK_N + tile_elems, cache_modifier=".cg")
                _finish_tile(acc_g, acc_u, bg_ptr, bu_ptr, h_ptr, offs_m, offs_n, M, N, stride_bg, stride_bu,
                             ACT, HAS_UP, HAS_BG, HAS_BU)


@cache
def streamk_config(M: int, N: int, K: int, itemsize: int, device: torch.device) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, programs, num_warps, num_stages) for this shape: tiles as tall as M allows (up to
    128 rows, so x is read from L2 once per weight panel), 64 columns, and programs a multiple of the SM count."""
    if INTERPRET:
        return 16, 32, 32, 5, 4, 1
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    block_n = 64
    block_k = 128 if block_m <= 32 else 64
    warps = 8 if block_m == 128 else 4
    stages = 4
    while stages > 1 and not k_loop_fits(stages, block_m, block_k, block_n, 2, itemsize):
        stages -= 1
    smem = stages * (block_m * block_k + 2 * block_k * block_n) * itemsize
    per_sm = 2 if smem <= 100 * 1024 else 1
    return block_m, block_n, block_k, per_sm * num_sms(device), warps, stages


_launch = Launcher(_gate_up_act_streamk_kernel)


def gate_up_act_streamk(x2: Tensor, w_gate: Tensor, b_gate: Tensor | None, w_up: Tensor | None, b_up: Tensor | None,
                        activation: str, config: tuple[int, ...] | None = None) -> Tensor:
    """h (M, I) = act(x2 @ w_gateᵀ + b_gate) * (x2 @ w_upᵀ + b_up), in x2's dtype (gate_up_act's contract), with a
    stream-K schedule; ``config`` overrides ``streamk_config`` (for tests and sweeps)."""
    act = get_activation(activation)
    M, K = x2.shape
    N = w_gate.shape[0]
    h = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return h
    BM, BN, BK, programs, warps, stages = config or streamk_config(M, N, K, x2.element_size(), x2.device)
    tiles = cdiv(M, BM) * cdiv(N, BN)
    k_iters = cdiv(K, BK)
    iters = cdiv(tiles * k_iters, programs)  # units per program
    grid = cdiv(tiles * k_iters, iters)
    max_parts = cdiv(k_iters, iters) + 1  # the most programs one tile can be shared by
    shared = grid > 1 and (iters % k_iters != 0)  # else every program takes whole tiles: no partials
    partials = torch.empty(tiles * max_parts * 2 * BM * BN if shared else 1, device=x2.device, dtype=torch.float32)
    counters = (torch.zeros if shared else torch.empty)(tiles, device=x2.device, dtype=torch.int32)
    wu, bg, bu = stand_ins(w_gate, b_gate, w_up, b_up, h)
    (sxm, sxk), (sgn, sgk), (sun, suk) = x2.stride(), w_gate.stride(), wu.stride()
    sbg, sbu, precision = bg.stride(0), bu.stride(0), dot_precision(x2.dtype)
    has_up, has_bg, has_bu = w_up is not None, b_gate is not None, b_up is not None
    key = (x2.get_device(), x2.dtype, M, N, K, iters, max_parts, sxm, sxk, sgn, sgk, sun, suk, sbg, sbu,
           aligned(x2, w_gate, bg, wu, bu), act.name, has_up, has_bg, has_bu, precision, BM, BN, BK, warps, stages)
    _launch(
        key, (grid,),
        x2, w_gate, bg, wu, bu, h, partials, counters,
        M, N, K, iters, max_parts,
        sxm, sxk, sgn, sgk, sun, suk, sbg, sbu,
        ACT=act.triton_fn, HAS_UP=has_up, HAS_BG=has_bg, HAS_BU=has_bu, PRECISION=precision,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps, num_stages=stages,
    )
    return h
