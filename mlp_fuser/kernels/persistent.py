"""The whole MLP in ONE persistent launch: y = (act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up)) @ w_downᵀ + b_down.

Why: at batched decode (M = 16-128) each GEMM is a stream of weight bytes, and each alone leaves SMs idle. Gate/up
at K = 4096, I = 11008 has 172 tiles of 64 columns on 132 SMs: its last wave keeps only 40 SMs busy. The down
projection back to 4096 has only 64 output tiles of 64. Here one launch does both. SMs left idle by gate/up's last
wave already stream w_down for the columns of h that are done.

Schedule: a flat list of work items, claimed one at a time from a work counter (``tl.atomic_add``) by a persistent
grid of P = min(num_sms · PROGRAMS_PER_SM, items) programs.
- Phase A, items [0, TA): the tiles of h = act(gate) * up, BLOCK_M rows by BLOCK_N columns of I (``gate_up_tile``),
  I-block-major, so the first columns of h are done first. Each tile is stored into the workspace h, then a ready
  counter per (chunk, m-block) is raised (release). A chunk is CHUNK_TILES consecutive column tiles of h.
- Phase B, items [TA, TA + TB): pieces of the down projection, one per (chunk, m-block, o-block), chunk-major. A
  piece waits until its chunk's ready counter counts every tile of the chunk (acquire), then computes
  h[m-block, chunk] @ w_down[o-block, chunk]ᵀ in fp32. The pieces of an output tile are summed as in split-K
  (splitk.py): each stores an fp32 partial, an arrival counter tells the last one to sum the partials in chunk
  order, add b_down, cast and store y. With one chunk the piece stores y itself.
Memory order: a tile's threads store h, meet at a barrier, then one thread raises the ready counter (release); a
piece reads the counter (acquire), meets its threads at a barrier, then loads h through L2 (.cg: L1 is not coherent
between SMs). The partials and their arrival counter (acq_rel) follow splitk.py.
No deadlock, whatever else runs on the GPU: an item is claimed only after every item before it, so a piece waits
only on tiles already claimed by running programs, and tiles never wait.

Workspace, per call (the op keeps no tensor between calls; no host sync, so it is CUDA-graph safe): one zeroed
int32 tensor for every counter (the work counter, the ready counters, the arrival counters: one memset), h (M, I) in
x's dtype and the partials [NUM_CHUNKS, M, O] in fp32 (none with one chunk).
Extra bytes over the weights: h written once and read once (2·M·I elements in x's dtype; the pieces of other
o-blocks read it again, from L2), and the partials written and read once (NUM_CHUNKS · M · O · 4 bytes each way).
Both are small next to the weights at small M. x is read once per tile of h, from L2.
Deterministic: h is rounded once, and the partials are summed in chunk order whatever order the pieces arrive in.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..activations import get_activation
from .common import INTERPRET, Launcher, aligned, cdiv, dot_precision, k_loop_fits, num_sms
from .gemm import gate_up_tile


@triton.jit
def _fused_mlp_persistent_kernel(
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, wd_ptr, bd_ptr, y_ptr, h_ptr, partials_ptr, counters_ptr,
    M, K, I, O,
    stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk, stride_bg, stride_bu,
    stride_wdo, stride_wdi, stride_bd,
    ACT: tl.constexpr,  # the activation, a @triton.jit function of an fp32 block
    HAS_UP: tl.constexpr,  # gated: h = act(gate) * up; else h = act(gate)
    HAS_BG: tl.constexpr,  # b_gate is given
    HAS_BU: tl.constexpr,  # b_up is given
    HAS_BD: tl.constexpr,  # b_down is given
    PRECISION: tl.constexpr,  # tl.dot's input_precision
    BLOCK_M: tl.constexpr,  # rows of x, h and y per item
    BLOCK_N: tl.constexpr,  # columns of h per gate/up tile
    BLOCK_K: tl.constexpr,  # the reduction step of both GEMMs (over K in phase A, over I in phase B)
    BLOCK_O: tl.constexpr,  # columns of y per down-projection piece
    CHUNK_TILES: tl.constexpr,  # gate/up column tiles per chunk of I (the last chunk may have fewer)
    NUM_CHUNKS: tl.constexpr,  # cdiv(cdiv(I, BLOCK_N), CHUNK_TILES): pieces summed per tile of y
):
    num_m = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(I, BLOCK_N)
    num_o = tl.cdiv(O, BLOCK_O)
    items_a = num_m * n_tiles
    n_items = items_a + NUM_CHUNKS * num_m * num_o
    # counters: [work, ready (NUM_CHUNKS, num_m), arrivals (num_m, num_o)], int32, zeroed before the launch
    work_ptr = counters_ptr
    ready_ptr = counters_ptr + 1
    arrive_ptr = counters_ptr + 1 + NUM_CHUNKS * num_m
    offs_k = tl.arange(0, BLOCK_K)

    item = tl.atomic_add(work_ptr, 1)
    while item < n_items:
        if item < items_a:
            # -- phase A: one tile of h, then its chunk's ready counter ----------------------------------------
            pid_n = item // num_m  # I-block-major: the first columns of h are done first
            pid_m = item % num_m
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x and h
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of w_gate and w_up = columns of h
            mask_m = offs_m < M
            mask_n = offs_n < I
            h = gate_up_tile(
                x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, offs_m, offs_n, mask_m, mask_n, K,
                stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk, stride_bg, stride_bu,
                ACT, HAS_UP, HAS_BG, HAS_BU, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
            )
            tl.store(h_ptr + offs_m[:, None] * I + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=mask_m[:, None] & mask_n[None, :])
            tl.debug_barrier()  # every thread's part of the tile is issued before the counter moves
            tl.atomic_add(ready_ptr + (pid_n // CHUNK_TILES) * num_m + pid_m, 1, sem="release")
        else:
            # -- phase B: h[m-block, chunk] @ w_down[o-block, chunk]ᵀ once the chunk is ready --------------------
            piece = item - items_a
            chunk = piece // (num_m * num_o)  # chunk-major: the earliest chunk first
            pid_m = piece % num_m  # the m-blocks of one w_down tile are adjacent
            pid_o = (piece // num_m) % num_o
            expected = tl.minimum(CHUNK_TILES, n_tiles - chunk * CHUNK_TILES)  # the chunk's tiles
            while tl.atomic_add(ready_ptr + chunk * num_m + pid_m, 0, sem="acquire") < expected:
                pass
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of h and y
            offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)  # rows of w_down = columns of y
            mask_m = offs_m < M
            mask_o = offs_o < O
            i_lo = chunk * (CHUNK_TILES * BLOCK_N)
            i_hi = tl.minimum(i_lo + CHUNK_TILES * BLOCK_N, I)
            acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
            for i in range(i_lo, i_hi, BLOCK_K):
                ii = i + offs_k  # the columns of h of this step
                # h was written by other programs of this launch: read through L2 (.cg), L1 is not coherent
                hh = tl.load(h_ptr + offs_m[:, None] * I + ii[None, :], mask=mask_m[:, None] & (ii[None, :] < i_hi),
                             other=0.0, cache_modifier=".cg")
                w = tl.load(wd_ptr + offs_o[None, :] * stride_wdo + ii[:, None] * stride_wdi,
                            mask=mask_o[None, :] & (ii[:, None] < i_hi), other=0.0)
                acc = tl.dot(hh, w, acc, input_precision=PRECISION)

            mask_y = mask_m[:, None] & mask_o[None, :]  # the tile's valid elements, in y and in the partials
            y_ptrs = y_ptr + offs_m[:, None] * O + offs_o[None, :]
            if NUM_CHUNKS == 1:
                if HAS_BD:
                    acc += tl.load(bd_ptr + offs_o * stride_bd, mask=mask_o, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_y)
            else:
                # partials are laid out [chunk, M, O], contiguous, fp32
                partial_ptrs = partials_ptr + offs_m[:, None] * O + offs_o[None, :]
                tl.store(partial_ptrs + chunk * M * O, acc, mask=mask_y)
                tl.debug_barrier()  # every thread's partial is issued before the counter moves
                done = tl.atomic_add(arrive_ptr + pid_m * num_o + pid_o, 1, sem="acq_rel")
                if done == NUM_CHUNKS - 1:  # the last piece of this tile of y: sum in chunk order
                    y = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
                    for c in range(NUM_CHUNKS):
                        y += tl.load(partial_ptrs + c * M * O, mask=mask_y, other=0.0, cache_modifier=".cg")
                    if HAS_BD:
                        y += tl.load(bd_ptr + offs_o * stride_bd, mask=mask_o, other=0.0).to(tl.float32)[None, :]
                    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_y)
        item = tl.atomic_add(work_ptr, 1)


@cache
def persistent_config(M: int, K: int, I: int, O: int, itemsize: int, device: torch.device) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_O, CHUNK_TILES, PROGRAMS_PER_SM, num_warps, num_stages) for this shape:
    64 columns per tile of h and of y, chunks of I such that the down projection has about two pieces per SM (at
    most 16 chunks, each at least 4 BLOCK_Ks long), as many pipeline stages as shared memory holds."""
    n_tiles = max(1, cdiv(I, 64))
    if INTERPRET:
        n_tiles = max(1, cdiv(I, 32))
        return 16, 32, 32, 32, cdiv(n_tiles, min(3, n_tiles)), 1, 4, 1
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64  # more rows: several m-blocks
    block_n = block_o = 64
    block_k = 128 if itemsize <= 2 else 32
    stages = 4  # gate/up's K loop (two weight tiles per step) is the larger of the two
    while stages > 1 and not k_loop_fits(stages, block_m, block_k, block_n, 2, itemsize):
        stages -= 1
    smem = stages * (block_m * block_k + 2 * block_k * block_n) * itemsize
    per_sm = max(1, min(2, (220 * 1024) // smem))
    sms = num_sms(device)
    out_tiles = cdiv(M, block_m) * cdiv(O, block_o)
    min_tiles = cdiv(4 * block_k, block_n)  # a chunk is at least 4 BLOCK_Ks long
    chunks = max(1, min(16, cdiv(2 * sms, out_tiles), n_tiles // min_tiles))
    step = max(1, block_k // block_n)  # chunks a whole number of BLOCK_Ks wide
    chunk_tiles = cdiv(cdiv(n_tiles, chunks), step) * step
    warps = 4 if block_m <= 32 else 8
    return block_m, block_n, block_k, block_o, chunk_tiles, per_sm, warps, stages


def _plan(M: int, I: int, O: int, config: tuple) -> tuple[int, int, int]:
    """(number of chunks, number of counters, work items) for a config."""
    BM, BN, _, BO, chunk_tiles = config[:5]
    n_tiles, num_m, num_o = cdiv(I, BN), cdiv(M, BM), cdiv(O, BO)
    chunks = cdiv(n_tiles, chunk_tiles)
    return chunks, 1 + chunks * num_m + num_m * num_o, num_m * n_tiles + chunks * num_m * num_o


def _workspace(M: int, I: int, O: int, chunks: int, n_counters: int, dtype: torch.dtype, device: torch.device):
    """(counters, h, partials): the call's own workspace. The counters ([work, ready, arrivals], int32) start at 0;
    h and the partials are written before they are read. With one chunk there are no partials."""
    counters = torch.zeros(n_counters, device=device, dtype=torch.int32)
    h = torch.empty((M, I), device=device, dtype=dtype)
    partials = torch.empty(chunks * M * O if chunks > 1 else 1, device=device, dtype=torch.float32)
    return counters, h, partials


_launch = Launcher(_fused_mlp_persistent_kernel)


def fused_mlp_persistent(x2: Tensor, w_gate: Tensor, b_gate: Tensor | None, w_up: Tensor | None, b_up: Tensor | None,
                         w_down: Tensor, b_down: Tensor | None, activation: str,
                         config: tuple[int, ...] | None = None) -> Tensor:
    """y (M, O) = (act(x2 @ w_gateᵀ + b_gate) * (x2 @ w_upᵀ + b_up)) @ w_downᵀ + b_down in x2's dtype, in one
    persistent launch (no product when w_up is None; any bias may be None; any strides). ``config`` overrides
    ``persistent_config`` (for tests and sweeps)."""
    act = get_activation(activation)
    M, K = x2.shape
    I, O = w_gate.shape[0], w_down.shape[0]
    y = torch.empty((M, O), dtype=x2.dtype, device=x2.device)
    if M == 0 or O == 0:
        return y
    if I == 0:  # h is empty: y = b_down
        return y.zero_() if b_down is None else y.copy_(b_down.expand(M, O))
    config = config or persistent_config(M, K, I, O, x2.element_size(), x2.device)
    BM, BN, BK, BO, chunk_tiles, per_sm, warps, stages = config
    chunks, n_counters, items = _plan(M, I, O, config)
    grid = min(num_sms(x2.device) * per_sm, items)
    counters, h, partials = _workspace(M, I, O, chunks, n_counters, x2.dtype, x2.device)
    wu = w_up if w_up is not None else w_gate  # valid pointers and strides, never read
    bg = b_gate if b_gate is not None else h
    bu = b_up if b_up is not None else h
    bd = b_down if b_down is not None else h
    (sxm, sxk), (sgn, sgk), (sun, suk), (sdo, sdi) = x2.stride(), w_gate.stride(), wu.stride(), w_down.stride()
    sbg, sbu, sbd, precision = bg.stride(0), bu.stride(0), bd.stride(0), dot_precision(x2.dtype)
    has_up, has_bg, has_bu, has_bd = w_up is not None, b_gate is not None, b_up is not None, b_down is not None
    key = (x2.get_device(), x2.dtype, M, K, I, O, sxm, sxk, sgn, sgk, sun, suk, sbg, sbu, sdo, sdi, sbd,
           aligned(x2, w_gate, bg, wu, bu, w_down, bd, y, h, partials, counters), act.name, has_up, has_bg, has_bu,
           has_bd, precision, BM, BN, BK, BO, chunk_tiles, chunks, grid, warps, stages)
    _launch(
        key, (grid,),
        x2, w_gate, bg, wu, bu, w_down, bd, y, h, partials, counters,
        M, K, I, O,
        sxm, sxk, sgn, sgk, sun, suk, sbg, sbu, sdo, sdi, sbd,
        ACT=act.triton_fn, HAS_UP=has_up, HAS_BG=has_bg, HAS_BU=has_bu, HAS_BD=has_bd, PRECISION=precision,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_O=BO, CHUNK_TILES=chunk_tiles, NUM_CHUNKS=chunks,
        num_warps=warps, num_stages=stages,
    )
    return y
