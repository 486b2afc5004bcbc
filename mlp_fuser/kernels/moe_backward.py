"""The backward of the routed experts (``kernels/moe.py``) on the sorted routing, in Triton.

Forward per pair p (token t = p // k, expert e): gu = x[t] Wgu[e]ᵀ + bgu[e]; h = A(g, u); o = h Wd[e]ᵀ + bd[e];
y[t] = Σ_j w[t, j] o_p. Given dy, three kinds of launch, none synchronising with the host:

- ``_moe_bwd_act_kernel``, per (block of one expert's pairs, BLOCK_N columns of h): over H at once it recomputes
  g, u = x Wgu[e]ᵀ and takes dh' = dy[t] Wd[e] (three fp32 accumulators from one x and one dy tile), then in its
  epilogue h = A(g, u), dw_p's partial <dh', h> (<dy, bd[e]> apart: ``_dy_bias``), dh = w_p dh', (dg, du) = A'·dh,
  stored in Wgu's row layout. Nothing of the forward is saved but its inputs; or (``gu``, backward "save") g and u as
  the forward's gate/up kernel stored them per pair, read in the epilogue instead of the two recomputed products.
- dx: dx_p = [dg du]_p Wgu[e] is ``moe_down`` on the transposed weight view, summed over each token's k pairs by
  ``moe_combine`` in j order. Or (``dgrad="grouped"``) torch's grouped GEMM on the act kernel's compact sorted copy
  of [dg du] (``COPY``) and Wgu as stored, summed per token by ``moe_grouped_wgrad.grouped_dx``.
- ``_moe_wgrad_kernel``, per (expert, BLOCK_N rows, BLOCK_K columns of dW[e]): loops over that expert's blocks,
  dWd[e] = Σ (w_p dy[t])ᵀ h_p and dWgu[e] = Σ [dg du]_pᵀ x[t], the bias gradient summed by the column-0 programs
  in a pass of their own after their tile.
  Or (``wgrad="grouped"``) torch's grouped GEMM on expert-sorted copies of the operands, which the act kernel
  writes (``SORTED``) or ``moe_grouped_wgrad`` gathers.

Float8 experts (``scales``: frozen, no biases; LoRA on an FP8 base): dx and dwts only. The act kernel (FP8) and
``_moe_bwd_dx_fp8_kernel`` (dx over Wgu's rows) read each weight tile as stored and multiply it by its rows' scales
in registers, rounded to x's dtype (the values ``fp8.dequantize_experts`` gives); no copy of a weight exists.

No atomics on any gradient: dx and dwts are computed per pair and summed in j order, so they are bitwise
reproducible; a weight gradient sums its expert's pairs in the routing's order, which ``moe_align``'s atomic version
(many pairs) may change from call to call. fp32 accumulation; h and [dg du] are rounded to x's dtype once.
Every layout and activation of the forward is supported (gated concatenated or interleaved, plain, biases, the
clamps, GPT-OSS's g·σ(αg)); fp64 raises NotImplementedError (the caller keeps the aten reference for it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..activations import get_activation
from . import moe_grouped_wgrad as gw
from .common import INTERPRET, cdiv, dot_precision, launch, num_sms
from .moe import (
    ExpertAct,
    _gate_up_layout,
    _launch_opts,
    add_gate_up_bias,
    default_config,
    load_gu,
    moe_combine,
    moe_down,
    moe_gate_up,
    paired_rows,
    scale_rows,
    store_gu,
)
from .moe_grouped_wgrad import compact_rows
from .moe_routing import Routing, moe_align

__all__ = ["moe_backward", "MoEExpertsFunction", "moe_experts_autograd", "backward_config"]

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)
_SILU = ExpertAct()


@triton.jit
def gated_act_bwd(g, u, dh, ACT: tl.constexpr, ACT_GRAD: tl.constexpr, ALPHA: tl.constexpr,
                  HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr, CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr):
    """(h, dg, du) in fp32 for h = A(g, u) as ``gated_act`` computes it; a clamp passes no gradient where it bites."""
    keep_g = g == g
    keep_u = u == u
    if HAS_LIMIT and not CLAMP_AFTER:
        keep_g = g <= LIMIT
        keep_u = (u >= -LIMIT) & (u <= LIMIT)
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    if ALPHA != 0.0:
        s = tl.sigmoid(ALPHA * g)
        a = g * s
        da = s + ALPHA * g * s * (1.0 - s)
    else:
        a = ACT(g)
        da = ACT_GRAD(g)
    if HAS_LIMIT and CLAMP_AFTER:
        keep_g = a <= LIMIT
        keep_u = (u >= -LIMIT) & (u <= LIMIT)
        a = tl.minimum(a, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    uo = u + UP_OFFSET
    dg = tl.where(keep_g, dh * uo * da, 0.0)
    du = tl.where(keep_u, dh * a, 0.0)
    return a * uo, dg, du


@triton.jit
def dequantized(w, s, dtype: tl.constexpr):
    """A float8 weight tile times its scales (broadcast to it), rounded to ``dtype``: the values of
    ``fp8.dequantize_experts``, in registers."""
    return (w.to(tl.float32) * s).to(dtype)


@triton.jit
def _fp8_act_loop(
    x_ptrs, dy_ptrs, wg_ptrs, wu_ptrs, wd_ptrs, acc_g, acc_u, acc_d, e, offs_n, offs_k, mask_m, mask_n, H, I,
    stride_xk, stride_dyk, stride_wk, stride_dn, sgu_ptr, stride_sge, stride_sgn, stride_sgk, UP_SOFF, UP_SROW,
    sd_ptr, stride_sde, stride_sdn, stride_sdk, col0, GATED: tl.constexpr, GATE_STEP: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, GU_K_SCALED: tl.constexpr, GU_SBN: tl.constexpr,
    GU_SBK: tl.constexpr, D_K_SCALED: tl.constexpr, D_SBN: tl.constexpr, D_SBK: tl.constexpr,
):
    """The act kernel's loop over H on float8 weights: each Wgu tile times its rows' scales at this step's K block
    (BLOCK_K divides GU_SBK), each Wd tile (H rows, the program's I columns from ``col0``) times its rows' scales at
    the columns' block (BLOCK_N divides D_SBK); tiles in x's dtype, the dots as the bf16 kernel's."""
    sg_ptrs, su_ptrs = scale_rows(sgu_ptr, e, offs_n, I, stride_sge, stride_sgn, GATE_STEP, UP_SOFF, UP_SROW, GU_SBN)
    sd_e = sd_ptr + e * stride_sde
    if D_K_SCALED:
        sd_e += (col0 // D_SBK) * stride_sdk
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        mask_k = offs_k < H - k * BLOCK_K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        dy = tl.load(dy_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        s_k = 0
        if GU_K_SCALED:
            s_k = (k * BLOCK_K // GU_SBK) * stride_sgk
        wg = dequantized(tl.load(wg_ptrs, mask=w_mask, other=0.0), tl.load(sg_ptrs + s_k)[None, :], x.dtype)
        acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION)
        if GATED:
            wu = dequantized(tl.load(wu_ptrs, mask=w_mask, other=0.0), tl.load(su_ptrs + s_k)[None, :], x.dtype)
            acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION)
        rows = tl.minimum(k * BLOCK_K + offs_k, H - 1)  # this step's rows of Wd (past H: the last one's scale)
        s_d = tl.load(sd_e + (rows // D_SBN) * stride_sdn)
        wd = dequantized(tl.load(wd_ptrs, mask=w_mask, other=0.0), s_d[:, None], dy.dtype)
        acc_d = tl.dot(dy, wd, acc_d, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        dy_ptrs += BLOCK_K * stride_dyk
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
        wd_ptrs += BLOCK_K * stride_dn
    return acc_g, acc_u, acc_d


@triton.jit
def _moe_bwd_act_kernel(
    x_ptr, dy_ptr, wgu_ptr, bgu_ptr, wd_ptr, wts_ptr, h_ptr, dgu_ptr, dw_ptr,
    sorted_ptr, block_expert_ptr, num_blocks_ptr, dgus_ptr, shift_ptr, dbgu_ptr, crow_ptr,
    S, K_TOP, I, H, N_GU, UP_ROW, N_TILES,
    stride_xm, stride_xk, stride_dym, stride_dyk, stride_we, stride_wn, stride_wk, stride_be, stride_bn,
    stride_de, stride_dn, stride_dk, stride_wt, stride_wj,
    sgu_ptr, stride_sge, stride_sgn, stride_sgk, UP_SOFF, UP_SROW, sd_ptr, stride_sde, stride_sdn, stride_sdk, gu_ptr,
    GATED: tl.constexpr, HAS_BGU: tl.constexpr, GATE_STEP: tl.constexpr,
    ACT: tl.constexpr, ACT_GRAD: tl.constexpr, ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
    CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SORTED: tl.constexpr,
    FP8: tl.constexpr, GU_K_SCALED: tl.constexpr, GU_SBN: tl.constexpr, GU_SBK: tl.constexpr,
    D_K_SCALED: tl.constexpr, D_SBN: tl.constexpr, D_SBK: tl.constexpr, SAVED: tl.constexpr,
    COPY: tl.constexpr, PAIR_DGU: tl.constexpr, PAIRED: tl.constexpr = False,
):
    # -- this program's block of pairs (one expert) and BLOCK_N columns of h -------------------------
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_b >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + pid_b).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < S
    tokens = pairs // K_TOP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)

    # -- over H: g, u = x Wgu[e]ᵀ (recomputed unless SAVED) and dh' = dy Wd[e], tiles (BLOCK_K, BLOCK_N) of each weight
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk
    dy_ptrs = dy_ptr + tokens[:, None] * stride_dym + offs_k[None, :] * stride_dyk
    wg_ptrs = wgu_ptr + e * stride_we + (offs_n * GATE_STEP)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    wu_ptrs = wg_ptrs + UP_ROW * stride_wn
    wd_ptrs = wd_ptr + e * stride_de + offs_k[:, None] * stride_dn + offs_n[None, :] * stride_dk
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:  # float8 weights (no biases): each tile dequantized in registers, never in memory
        acc_g, acc_u, acc_d = _fp8_act_loop(
            x_ptrs, dy_ptrs, wg_ptrs, wu_ptrs, wd_ptrs, acc_g, acc_u, acc_d, e, offs_n, offs_k, mask_m, mask_n, H, I,
            stride_xk, stride_dyk, stride_wk, stride_dn, sgu_ptr, stride_sge, stride_sgn, stride_sgk, UP_SOFF,
            UP_SROW, sd_ptr, stride_sde, stride_sdn, stride_sdk, pid_n * BLOCK_N, GATED, GATE_STEP, PRECISION,
            BLOCK_K, GU_K_SCALED, GU_SBN, GU_SBK, D_K_SCALED, D_SBN, D_SBK)
    else:
        if PAIRED:  # gate and up rows interleaved along the weight's contiguous dim: one (BLOCK_K, 2·BLOCK_N) tile
            offs_r = 2 * pid_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
            wg_ptrs = wgu_ptr + e * stride_we + offs_r[None, :] * stride_wn + offs_k[:, None] * stride_wk
            acc_gu = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            mask_k = offs_k < H - k * BLOCK_K
            if not SAVED:
                x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            dy = tl.load(dy_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w_mask = mask_k[:, None] & mask_n[None, :]
            if PAIRED:
                wgu = tl.load(wg_ptrs, mask=mask_k[:, None] & (offs_r < 2 * I)[None, :], other=0.0)
                acc_gu = tl.dot(x, wgu, acc_gu, input_precision=PRECISION)
            elif not SAVED:
                acc_g = tl.dot(x, tl.load(wg_ptrs, mask=w_mask, other=0.0), acc_g, input_precision=PRECISION)
                if GATED:
                    acc_u = tl.dot(x, tl.load(wu_ptrs, mask=w_mask, other=0.0), acc_u, input_precision=PRECISION)
            acc_d = tl.dot(dy, tl.load(wd_ptrs, mask=w_mask, other=0.0), acc_d, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            dy_ptrs += BLOCK_K * stride_dyk
            wg_ptrs += BLOCK_K * stride_wk
            wu_ptrs += BLOCK_K * stride_wk
            wd_ptrs += BLOCK_K * stride_dn
        if PAIRED:
            acc_g, acc_u = tl.split(tl.reshape(acc_gu, (BLOCK_M, BLOCK_N, 2)))

    # -- epilogue: biases, h, A'(g, u) · (w_p dh'), dw_p's partial over these columns -------------------
    if SAVED:  # the forward's g and u (biases in), as it stored them per pair
        acc_g, acc_u = load_gu(gu_ptr, pairs.to(tl.int64), offs_n, mask_m[:, None] & mask_n[None, :], N_GU, UP_ROW,
                                GATED, GATE_STEP, mask_m, pid_n * BLOCK_N, BLOCK_M, BLOCK_N)
    elif HAS_BGU:
        acc_g, acc_u = add_gate_up_bias(acc_g, acc_u, bgu_ptr, e, offs_n, mask_n, stride_be, stride_bn, UP_ROW,
                                        GATED, GATE_STEP)
    wts = tl.load(wts_ptr + tokens * stride_wt + (pairs % K_TOP) * stride_wj, mask=mask_m, other=0.0)
    dh = acc_d * wts.to(tl.float32)[:, None]
    if GATED:
        h, dg, du = gated_act_bwd(acc_g, acc_u, dh, ACT, ACT_GRAD, ALPHA, HAS_LIMIT, LIMIT, CLAMP_AFTER, UP_OFFSET)
    else:
        h = ACT(acc_g)
        dg = dh * ACT_GRAD(acc_g)
        du = dg  # no up half: never stored
    h = h.to(h_ptr.dtype.element_ty)  # o was computed from the rounded h
    dw = tl.sum(tl.where(mask_n[None, :], acc_d * h.to(tl.float32), 0.0), axis=1)  # the bias term: ``_dy_bias``
    rows = pairs.to(tl.int64)
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(dw_ptr + rows * N_TILES + pid_n, dw, mask=mask_m)
    dg = dg.to(dgu_ptr.dtype.element_ty)
    du = du.to(dgu_ptr.dtype.element_ty)
    if PAIR_DGU:  # per pair: the Triton dx and wgrad kernels read it so
        store_gu(dgu_ptr, rows, dg, du, offs_n, mask, N_GU, UP_ROW, GATED, GATE_STEP, mask_m, pid_n * BLOCK_N,
                  BLOCK_M, BLOCK_N)
    if COPY:  # grouped_mm's [dg du] in compact sorted order, and each pair's row there (grouped dx sums them)
        srows = compact_rows(pid_b, e, shift_ptr, BLOCK_M)
        store_gu(dgus_ptr, srows, dg, du, offs_n, mask, N_GU, UP_ROW, GATED, GATE_STEP, mask_m, pid_n * BLOCK_N,
                  BLOCK_M, BLOCK_N)
        tl.store(crow_ptr + rows, srows.to(tl.int32), mask=mask_m & (pid_n == 0))
    if SORTED:  # the weight gradients' grouped_mm operands in compact sorted order: h, [dg du]'s bias sums per block
        srows = compact_rows(pid_b, e, shift_ptr, BLOCK_M)
        tl.store(h_ptr + srows[:, None] * I + offs_n[None, :], h, mask=mask)
        if HAS_BGU:
            sums = dbgu_ptr + pid_b.to(tl.int64) * N_GU + offs_n * GATE_STEP
            tl.store(sums, tl.sum(tl.where(mask, dg.to(tl.float32), 0.0), axis=0), mask=mask_n)
            if GATED:
                tl.store(sums + UP_ROW, tl.sum(tl.where(mask, du.to(tl.float32), 0.0), axis=0), mask=mask_n)
    else:
        tl.store(h_ptr + rows[:, None] * I + offs_n[None, :], h, mask=mask)


@triton.jit
def _moe_bwd_dx_fp8_kernel(
    dgu_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
    S, H, N_GU, UP_ROW, UP_SOFF, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    SPLIT: tl.constexpr, K_SCALED: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # -- one expert's block of pairs, BLOCK_N columns of H: dx_p = [dg du]_p Wgu[e], over Wgu's rows -------------
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_b >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + pid_b).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = pairs < S
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = dgu_ptr + pairs[:, None] * N_GU + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + offs_k[:, None] * stride_wn + offs_n[None, :] * stride_wk
    s_e = s_ptr + e * stride_se
    if K_SCALED:  # the program's H columns lie in one scale block of Wgu's K (BLOCK_N divides SBK)
        s_e += (pid_n * BLOCK_N // SBK) * stride_sk

    # -- each (BLOCK_K rows, BLOCK_N columns) tile of Wgu[e] times its rows' scales, in dgu's dtype ---------------
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(N_GU, BLOCK_K)):
        mask_k = offs_k < N_GU - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        rows = tl.minimum(k * BLOCK_K + offs_k, N_GU - 1)
        if SPLIT:  # gate and up quantized apart: up row UP_ROW + n reads scale row UP_SOFF + n // SBN
            s_rows = tl.where(rows >= UP_ROW, UP_SOFF + (rows - UP_ROW) // SBN, rows // SBN)
        else:
            s_rows = rows // SBN
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        w = dequantized(w, tl.load(s_e + s_rows * stride_sn)[:, None], a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wn
    tl.store(out_ptr + pairs[:, None] * H + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _a_block(a_ptr, sorted_ptr, blk, S, K_TOP, offs_n, mask_n, stride_am, stride_an, A_BY_TOKEN: tl.constexpr,
             BLOCK_M: tl.constexpr):
    """Sorted block ``blk`` of an expert's pairs: a's (BLOCK_N, BLOCK_M) tile read transposed (its row the pair's,
    or with A_BY_TOKEN its token's), the pairs, their tokens and which are real."""
    pairs = tl.load(sorted_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < S
    tokens = pairs // K_TOP
    if A_BY_TOKEN:
        rows_a = tokens.to(tl.int64)
    else:
        rows_a = pairs.to(tl.int64)
    a = tl.load(a_ptr + rows_a[None, :] * stride_am + offs_n[:, None] * stride_an,
                mask=mask_n[:, None] & mask_m[None, :], other=0.0)
    return a, pairs, tokens, mask_m


@triton.jit
def _wgrad_tile(
    e, pid_n, pid_k, a_ptr, b_ptr, wts_ptr, dw_ptr, db_ptr, sorted_ptr, expert_start_ptr,
    S, K_TOP, N, K,
    stride_am, stride_an, stride_bm, stride_bk, stride_wt, stride_wj, stride_de, stride_dn, stride_dk,
    stride_dbe, stride_dbn,
    A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr, SCALED: tl.constexpr, HAS_DB: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # -- dW[e][n-tile, k-tile] = Σ over expert e's pairs of a_pᵀ (s_p b_p); a's row is the pair's or its token's ---
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    first, end = tl.load(expert_start_ptr + e), tl.load(expert_start_ptr + e + 1)
    for blk in range(first, end):
        a, pairs, tokens, mask_m = _a_block(a_ptr, sorted_ptr, blk, S, K_TOP, offs_n, mask_n, stride_am, stride_an,
                                            A_BY_TOKEN, BLOCK_M)
        if B_BY_TOKEN:
            rows_b = tokens.to(tl.int64)
        else:
            rows_b = pairs.to(tl.int64)
        b = tl.load(b_ptr + rows_b[:, None] * stride_bm + offs_k[None, :] * stride_bk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if SCALED:
            s = tl.load(wts_ptr + tokens * stride_wt + (pairs % K_TOP) * stride_wj, mask=mask_m, other=0.0)
            # b, not a: an A operand changed in registers serializes the wgmmas (ptxas C7515, sm_90a)
            b = (b.to(tl.float32) * s.to(tl.float32)[:, None]).to(b_ptr.dtype.element_ty)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = dw_ptr + e.to(tl.int64) * stride_de + offs_n[:, None] * stride_dn + offs_k[None, :] * stride_dk
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_k[None, :])
    if HAS_DB:
        if pid_k == 0:  # one program per row tile sums the bias gradient, in a pass of its own over a after its dW
            # tile: in the loop above, a's fp32 (BLOCK_N, BLOCK_M) copy and its row sums beside the accumulator took
            # GPT-OSS's dWd launch to 255 registers and 120 bytes of spills (sm_90a), for a sum one program in
            # cdiv(K, BLOCK_K) keeps
            acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for blk in range(first, end):
                a_f, pairs, tokens, mask_m = _a_block(a_ptr, sorted_ptr, blk, S, K_TOP, offs_n, mask_n, stride_am,
                                                      stride_an, A_BY_TOKEN, BLOCK_M)
                a_f = a_f.to(tl.float32)
                if SCALED:
                    s = tl.load(wts_ptr + tokens * stride_wt + (pairs % K_TOP) * stride_wj, mask=mask_m, other=0.0)
                    a_f = a_f * s.to(tl.float32)[None, :]
                acc_b += tl.sum(a_f, axis=1)
            tl.store(db_ptr + e * stride_dbe + offs_n * stride_dbn, acc_b.to(db_ptr.dtype.element_ty),
                     mask=mask_n)


@triton.jit
def _moe_wgrad_kernel(
    a_ptr, b_ptr, wts_ptr, dw_ptr, db_ptr, sorted_ptr, expert_start_ptr,
    S, K_TOP, N, K, E,
    stride_am, stride_an, stride_bm, stride_bk, stride_wt, stride_wj, stride_de, stride_dn, stride_dk,
    stride_dbe, stride_dbn,
    A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr, SCALED: tl.constexpr, HAS_DB: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EXPERT_MAJOR: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
):
    if PERSISTENT:  # fewer programs, each walking tiles expert by expert: one tile's loads can overlap another's store
        tiles_k = tl.cdiv(K, BLOCK_K)
        per_expert = tl.cdiv(N, BLOCK_N) * tiles_k
        for tile in tl.range(tl.program_id(0), E * per_expert, tl.num_programs(0), flatten=FLATTEN):
            e = tile // per_expert
            r = tile % per_expert
            _wgrad_tile(e, r // tiles_k, r % tiles_k, a_ptr, b_ptr, wts_ptr, dw_ptr, db_ptr, sorted_ptr,
                        expert_start_ptr, S, K_TOP, N, K, stride_am, stride_an, stride_bm, stride_bk, stride_wt,
                        stride_wj, stride_de, stride_dn, stride_dk, stride_dbe, stride_dbn, A_BY_TOKEN, B_BY_TOKEN,
                        SCALED, HAS_DB, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        if EXPERT_MAJOR:  # an expert's tiles launch together: its rows of a and b stay in L2 while they are read
            pid_k = tl.program_id(0)
            pid_n = tl.program_id(1)
            e = tl.program_id(2)
        else:
            e = tl.program_id(0)
            pid_n = tl.program_id(1)
            pid_k = tl.program_id(2)
        _wgrad_tile(e, pid_n, pid_k, a_ptr, b_ptr, wts_ptr, dw_ptr, db_ptr, sorted_ptr, expert_start_ptr, S, K_TOP,
                    N, K, stride_am, stride_an, stride_bm, stride_bk, stride_wt, stride_wj, stride_de, stride_dn,
                    stride_dk, stride_dbe, stride_dbn, A_BY_TOKEN, B_BY_TOKEN, SCALED, HAS_DB, PRECISION, BLOCK_M,
                    BLOCK_N, BLOCK_K)


# ---- host side --------------------------------------------------------------------------------------


def _cfg(bn: int, bk: int, warps: int, stages: int) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


_INTERPRET_CONFIG = {"act": _cfg(32, 32, 4, 1), "wgrad": _cfg(32, 32, 4, 1)}


def backward_config(kind: str, block_m: int, dtype: torch.dtype, pairs: int = 0) -> dict:
    """Tiles for "act" (BLOCK_N columns of h, BLOCK_K of H per step: two activation and three weight tiles) and
    "wgrad" (a (BLOCK_N, BLOCK_K) tile of dW, BLOCK_M = the routing's block of pairs per step; ``pairs``: the call's
    T·k), stages fitted to shared memory; under the interpreter small tiles, so that the edges are exercised."""
    if INTERPRET:
        return dict(_INTERPRET_CONFIG[kind])
    itemsize = torch.empty((), dtype=dtype).element_size()
    if kind == "act":
        cfg = _cfg(64, 64 if itemsize == 2 else 32, 8 if block_m >= 128 else 4, 3)
        tiles = lambda c: 2 * block_m * c["BLOCK_K"] + 3 * c["BLOCK_K"] * c["BLOCK_N"]  # noqa: E731
    elif kind == "wgrad":  # a loop one or two blocks deep: stages buy nothing, CTAs in flight do (H100 sweep)
        if itemsize == 2:
            cfg = _cfg(128, 256, 8, 2) if pairs >= 32768 else _cfg(128, 128, 4, 2)
        else:
            cfg = _cfg(128, 64, 8, 3)
        tiles = lambda c: block_m * (c["BLOCK_N"] + c["BLOCK_K"])  # noqa: E731
    else:
        raise ValueError(f"backward_config: kind must be 'act' or 'wgrad', not {kind!r}")
    while cfg["num_stages"] > 1 and cfg["num_stages"] * tiles(cfg) * itemsize > 200 * 1024:
        cfg["num_stages"] -= 1
    return cfg


def _check(x: Tensor, act: ExpertAct) -> None:
    if x.dtype not in _SUPPORTED:
        raise NotImplementedError(f"moe_backward: x has dtype {x.dtype}; the Triton backward takes float16, "
                                  "bfloat16 or float32 (use the aten reference's autograd)")
    if get_activation(act.name).triton_grad is None:
        raise NotImplementedError(f"moe_backward: activation {act.name!r} has no Triton derivative")


def _wgrad(a: Tensor, b: Tensor, wts: Tensor | None, routing: Routing, expert_start: Tensor, E: int, N: int, K: int,
           a_by_token: bool, b_by_token: bool, dw: Tensor, db: Tensor | None, cfg: dict) -> None:
    """dw[e] (N, K) = Σ_p (w_p a_p)ᵀ b_p over expert e's pairs; db[e] = Σ_p w_p a_p. Writes every element."""
    S = b.shape[0] * routing.k if b_by_token else b.shape[0]
    s = wts if wts is not None else a
    d = db if db is not None else dw
    major, persistent = cfg.get("EXPERT_MAJOR", True), cfg.get("PERSISTENT", 0)  # PERSISTENT: programs per SM
    tiles = (cdiv(K, cfg["BLOCK_K"]), cdiv(N, cfg["BLOCK_N"]), E)
    if persistent:
        grid = (min(tiles[0] * tiles[1] * E, persistent * num_sms(dw.device)),)
    else:
        grid = tiles if major else tiles[::-1]
    launch(
        _moe_wgrad_kernel, grid,
        a, b, s, dw, d, routing.sorted_pairs, expert_start,
        S, routing.k, N, K, E,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), s.stride(0), s.stride(-1), *dw.stride(),
        d.stride(0), d.stride(-1),
        A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token, SCALED=wts is not None, HAS_DB=db is not None,
        PRECISION=dot_precision(a.dtype), BLOCK_M=routing.block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        EXPERT_MAJOR=major, PERSISTENT=bool(persistent), FLATTEN=cfg.get("FLATTEN", False), **_launch_opts(cfg),
    )


def _dy_bias(dy: Tensor, b_d: Tensor, ids: Tensor, E: int) -> Tensor:
    """(T, k) fp32: <dy[t], b_d[e]> for the pair (t, j) of expert e = ids[t, j] (0 for a dropped pair, id >= E), dw's
    bias term, from one (T, H) x (H, E) product. Not in the act kernel's K loop: there it was a reduction of the dy
    tile and a synchronous load of b_d every step of every program (the PTX loop 222 -> 368 instructions at GPT-OSS's
    sizes), for a sum only the first column tile used."""
    prod = torch.mm(dy.float(), b_d.float().t())
    valid = ids < E
    return torch.where(valid, prod.gather(1, torch.where(valid, ids, 0).long()), 0.0)


def _expert_start(routing: Routing, E: int) -> Tensor:
    """int32 (E + 1,): each expert's first block in the routing, and the used blocks' end."""
    be = routing.block_expert
    return torch.searchsorted(be, torch.arange(E + 1, dtype=be.dtype, device=be.device)).to(torch.int32)


def _within(cfg: dict, key: str, fe) -> dict:
    """``cfg`` with its tile ``key`` halved until it divides the scale block along K of float8 weights ``fe``
    (unchanged where their scales do not change along K); NotImplementedError where no tile of 16 or more can."""
    if not fe.k_scaled:
        return cfg
    if fe.block_k % 16:
        raise NotImplementedError(f"moe_backward: scale blocks {fe.block_k} wide along K; the kernels' tiles are "
                                  "multiples of 16 (use the aten reference)")
    cfg = dict(cfg)
    while fe.block_k % cfg[key]:
        cfg[key] //= 2
    return cfg


def _fp8_act_args(scales: tuple | None, up_row: int) -> tuple[tuple, dict]:
    """The act kernel's scale arguments and FP8 constexprs for float8 weights' ``scales``; for float weights None
    (no kernel parameter: the bf16 kernel as it was)."""
    if scales is None:
        return (None,) * 10, dict(FP8=False, GU_K_SCALED=False, GU_SBN=1, GU_SBK=1, D_K_SCALED=False, D_SBN=1,
                                  D_SBK=1)
    fgu, fd = scales
    return ((fgu.scale, *fgu.scale.stride(), fgu.up_soff, 0 if fgu.up_soff else up_row, fd.scale, *fd.scale.stride()),
            dict(FP8=True, GU_K_SCALED=fgu.k_scaled, GU_SBN=fgu.block_n, GU_SBK=fgu.block_k if fgu.k_scaled else 1,
                 D_K_SCALED=fd.k_scaled, D_SBN=fd.block_n, D_SBK=fd.block_k if fd.k_scaled else 1))


_DEQUANT_PER_THREAD = 64  # weight elements a thread dequantizes per K step (128 at 128 x 128 on 4 warps: spills)


def _fp8_dx(dgu: Tensor, routing: Routing, fgu, H: int, up_row: int, config: dict | None) -> Tensor:
    """out (S, H) fp32, row p = [dg du]_p Wgu[e] for pair p of expert e (dropped pairs unwritten), Wgu float8 with
    its scales ``fgu``, each tile dequantized in registers. ``config``: a ``moe_down`` config (BLOCK_M is the
    routing's), else the default for this GEMM's sizes."""
    S, N_GU = dgu.shape
    E = fgu.w.shape[0]
    out = torch.empty((S, H), dtype=torch.float32, device=dgu.device)
    n_blocks = routing.block_expert.shape[0]
    if n_blocks == 0 or H == 0:
        return out
    k = routing.k
    cfg = config or default_config("down", S // k, k, E, H, N_GU, dgu.dtype, dgu.device)
    cfg = _within(cfg, "BLOCK_N", fgu)
    while cfg["BLOCK_K"] > 16 and cfg["BLOCK_K"] * cfg["BLOCK_N"] > _DEQUANT_PER_THREAD * 32 * cfg["num_warps"]:
        cfg = {**cfg, "BLOCK_K": cfg["BLOCK_K"] // 2}  # the tile is dequantized in fp32 registers: keep it small
    sc = fgu.scale
    launch(
        _moe_bwd_dx_fp8_kernel, (n_blocks, cdiv(H, cfg["BLOCK_N"])),
        dgu, fgu.w, sc, out, routing.sorted_pairs, routing.block_expert, routing.num_blocks,
        S, H, N_GU, up_row, fgu.up_soff, *fgu.w.stride(), *sc.stride(),
        SPLIT=fgu.up_soff > 0, K_SCALED=fgu.k_scaled, SBN=fgu.block_n, SBK=fgu.block_k if fgu.k_scaled else 1,
        PRECISION=dot_precision(dgu.dtype), BLOCK_M=routing.block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        **_launch_opts(cfg),
    )
    return out


def moe_backward(x: Tensor, ids: Tensor, wts: Tensor, w_gu: Tensor, b_gu: Tensor | None, w_d: Tensor,
                 b_d: Tensor | None, act: ExpertAct, interleaved: bool, dy: Tensor, routing: Routing | None = None,
                 configs: dict | None = None, need_dx: bool = True, need_weights: bool = True,
                 wgrad: str = "triton", scales: tuple | None = None, gu: Tensor | None = None, dgrad: str = "triton",
                 ) -> tuple[Tensor | None, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """(dx, dwts, dw_gu, db_gu, dw_d, db_d) of ``moe_experts(x, ids, wts, w_gu, b_gu, w_d, b_d, act, interleaved)``
    given dy (T, H), each in its input's dtype (bias gradients None without biases). ``routing``: the forward's
    (any BLOCK_M), else built here. ``configs``: "act", "wgrad" (``backward_config``'s keys) and "dx" (a
    ``moe_down`` config), else the defaults. ``wgrad``: the weight gradients by the Triton kernel ("triton") or by
    torch's grouped GEMM on expert-sorted copies of the operands ("grouped", ``moe_grouped_wgrad``); ``dgrad``: dx
    by the down kernel ("triton") or by grouped_mm on the sorted copy of [dg du] and Wgu as stored ("grouped",
    float weights only), each token's k rows then summed in j order. Raises
    NotImplementedError for what it does not run (the caller falls back to the aten reference). Without
    ``need_dx`` / ``need_weights`` (frozen experts, LoRA) dx / the four weight and bias gradients are not computed
    and come back None. ``scales``: (gate/up's, down's) ``fp8.Fp8Experts`` of float8 weights w_gu and w_d, frozen
    and without biases: each weight tile dequantized in registers (the values ``fp8.dequantize_experts`` gives in
    x's dtype), dx by ``_moe_bwd_dx_fp8_kernel``; no copy of a weight is made. ``gu``: the forward's
    pre-activations (``moe_experts(gu=...)``: (S, 2I or I) per pair, biases in, x's dtype), read instead of
    recomputing x Wgu[e]ᵀ (backward "save")."""
    _check(x, act)
    if scales is not None and (need_weights or b_gu is not None or b_d is not None):
        raise ValueError("moe_backward: float8 experts are frozen and have no biases (need_weights=False, no biases)")
    T, H = x.shape
    k = ids.shape[1]
    E, _, I = w_d.shape
    S = T * k
    if gu is not None and (scales is not None or gu.shape != (S, w_gu.shape[1]) or gu.dtype != x.dtype
                           or not gu.is_contiguous()):
        raise ValueError(f"moe_backward: gu must be the forward's contiguous ({S}, {w_gu.shape[1]}) {x.dtype} "
                         f"pre-activations, of float weights; got {gu.dtype} {tuple(gu.shape)}")
    for name, mode in (("wgrad", wgrad), ("dgrad", dgrad)):
        if mode not in ("triton", "grouped"):
            raise ValueError(f"moe_backward: {name} must be 'triton' or 'grouped', not {mode!r}")
    if dgrad == "grouped" and scales is not None:
        raise ValueError("moe_backward: float8 experts take dx by their own kernel (dgrad='triton')")
    grouped = wgrad == "grouped" and need_weights
    grouped_dx = dgrad == "grouped" and need_dx
    if (grouped or grouped_dx) and (reason := gw.why_not(x.device, x.dtype, E, H, I, w_gu if grouped_dx else None)):
        raise NotImplementedError(f"moe_backward: no grouped_mm {'weight gradients' if grouped else 'dx'}: {reason}")
    gated, step, up_row = _gate_up_layout(w_gu, I, interleaved)
    if routing is None:
        routing = moe_align(ids, E, default_config("gate_up", T, k, E, H, I, x.dtype, x.device)["BLOCK_M"])
    dy = dy.to(x.dtype)
    dev = x.device
    if S == 0 or H == 0 or I == 0 or E == 0:
        zero = [torch.zeros(t.shape, dtype=t.dtype, device=dev) if t is not None and need_weights else None
                for t in (w_gu, b_gu, w_d, b_d)]
        return (torch.zeros_like(x) if need_dx else None, torch.zeros_like(wts), *zero)

    # -- h, [dg du] per pair and dw's partials per column tile (grouped: h and a copy of [dg du] sorted) ---------
    cfgs = {kind: backward_config(kind, routing.block_m, x.dtype, S) for kind in ("act", "wgrad")} | (configs or {})
    cfg = cfgs["act"]
    if scales is not None:  # a tile never straddles a scale block: gate/up's along H, down's along I
        cfg = _within(_within(cfg, "BLOCK_K", scales[0]), "BLOCK_N", scales[1])
    fp8_ints, fp8_flags = _fp8_act_args(scales, up_row)
    n_tiles = cdiv(I, cfg["BLOCK_N"])
    n_gu = w_gu.shape[1]
    n_blocks = routing.block_expert.shape[0]
    h = torch.empty((S, I), dtype=x.dtype, device=dev)
    pair_dgu = (need_dx and not grouped_dx) or (need_weights and not grouped)  # a Triton dx or wgrad reads it
    dgu = torch.empty((S, n_gu), dtype=x.dtype, device=dev) if pair_dgu else None
    dw_part = torch.zeros((S, n_tiles), dtype=torch.float32, device=dev)  # dropped pairs: no gradient
    bgu = b_gu if b_gu is not None else w_gu
    dgu_s = dbgu_part = shift = crow = None
    if grouped or grouped_dx:
        offs, shift = gw.compact_offsets(ids, routing, _expert_start(routing, E), E)
        dgu_s = torch.empty((S, n_gu), dtype=x.dtype, device=dev)
        crow = torch.empty((S,), dtype=torch.int32, device=dev)  # each pair's compact row (S int32: kept simple)
    if grouped and b_gu is not None:
        dbgu_part = torch.empty((n_blocks, n_gu), dtype=torch.float32, device=dev)
    # no [dg du] stored (dwts alone: frozen experts, no dx): h stands in for their pointers, never written
    dgu_pair = dgu if pair_dgu else dgu_s if dgu_s is not None else h
    launch(
        _moe_bwd_act_kernel, (n_blocks, n_tiles),
        x, dy, w_gu, bgu, w_d, wts, h, dgu_pair, dw_part,
        routing.sorted_pairs, routing.block_expert, routing.num_blocks,
        dgu_s if dgu_s is not None else dgu_pair, shift if shift is not None else routing.num_blocks,
        dbgu_part if dbgu_part is not None else dw_part, crow,
        S, k, I, H, n_gu, up_row, n_tiles,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), *w_gu.stride(), bgu.stride(0), bgu.stride(-1),
        *w_d.stride(), wts.stride(0), wts.stride(1), *fp8_ints, gu,
        GATED=gated, HAS_BGU=b_gu is not None, GATE_STEP=step,
        ACT_GRAD=get_activation(act.name).triton_grad, **act.constexprs(),
        PRECISION=dot_precision(x.dtype), BLOCK_M=routing.block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        SORTED=grouped, **fp8_flags, SAVED=gu is not None, COPY=dgu_s is not None, PAIR_DGU=pair_dgu,
        PAIRED=paired_rows(w_gu, step) and scales is None and gu is None, **_launch_opts(cfg),
    )
    dwts = dw_part.sum(1).view(T, k)
    if b_d is not None:
        dwts = dwts + _dy_bias(dy, b_d, ids, E)
    dwts = dwts.to(wts.dtype)

    # -- dx: [dg du]_p Wgu[e] per pair (the forward's down kernel on the transposed view), summed per token -----
    dx = None
    if grouped_dx:  # or grouped_mm on the compact copy, each token's rows found through crow
        dx = gw.grouped_dx(dgu_s, w_gu, offs, crow, ids, E)
    elif need_dx and scales is not None:
        dx = moe_combine(_fp8_dx(dgu, routing, scales[0], H, up_row, cfgs.get("dx")), ids, E, x.dtype)
    elif need_dx:
        ones = torch.ones((), dtype=torch.float32, device=dev).expand(T, k)
        dx = moe_combine(moe_down(dgu, routing, ones, w_gu.transpose(1, 2), None, cfgs.get("dx")), ids, E, x.dtype)
    if not need_weights:
        return dx, dwts, None, None, None, None
    if grouped:  # each sorted operand made just before its GEMM and freed after it
        del dgu
        dys, dbd_part = gw.sorted_rows(dy, wts, routing, shift, sums=b_d is not None)
        dw_d = gw.grouped_wgrad(dys, h, offs, w_d.dtype, like=w_d)
        del dys, h
        xs, _ = gw.sorted_rows(x, None, routing, shift)
        dw_gu = gw.grouped_wgrad(dgu_s, xs, offs, w_gu.dtype, like=w_gu)
        db_gu = gw.per_expert(dbgu_part, routing, E, b_gu) if b_gu is not None else None
        db_d = gw.per_expert(dbd_part, routing, E, b_d) if b_d is not None else None
        return dx, dwts, dw_gu, db_gu, dw_d, db_d
    dw_gu = torch.empty_like(w_gu)  # the weight's layout (a transposed view's too): the kernel writes by strides
    dw_d = torch.empty_like(w_d)
    db_gu = torch.empty(b_gu.shape, dtype=b_gu.dtype, device=dev) if b_gu is not None else None
    db_d = torch.empty(b_d.shape, dtype=b_d.dtype, device=dev) if b_d is not None else None

    # -- weight gradients: a program per (expert, tile), looping over the expert's blocks -----------------------
    expert_start = _expert_start(routing, E)
    _wgrad(dy, h, wts, routing, expert_start, E, H, I, True, False, dw_d, db_d, cfgs["wgrad"])
    _wgrad(dgu, x, None, routing, expert_start, E, w_gu.shape[1], H, False, True, dw_gu, db_gu, cfgs["wgrad"])
    return dx, dwts, dw_gu, db_gu, dw_d, db_d


class MoEExpertsFunction(torch.autograd.Function):
    """The sorted Triton forward (routing, gate_up, down, combine) and ``moe_backward``; saves only the inputs and
    the routing (h is recomputed in the backward)."""

    @staticmethod
    def forward(ctx, x, ids, wts, w_gu, b_gu, w_d, b_d, act: ExpertAct, interleaved: bool):
        T, H = x.shape
        k = ids.shape[1]
        E, _, I = w_d.shape
        _check(x, act)
        routing = moe_align(ids, E, default_config("gate_up", T, k, E, H, I, x.dtype, x.device)["BLOCK_M"])
        h = moe_gate_up(x, routing, w_gu, b_gu, act, I, interleaved)
        y = moe_combine(moe_down(h, routing, wts, w_d, b_d), ids, E, x.dtype)
        ctx.save_for_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, *routing[:3])
        ctx.meta = (act, interleaved, routing.block_m, routing.k)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, ids, wts, w_gu, b_gu, w_d, b_d, sorted_pairs, block_expert, num_blocks = ctx.saved_tensors
        act, interleaved, block_m, k = ctx.meta
        routing = Routing(sorted_pairs, block_expert, num_blocks, block_m, k)
        need = ctx.needs_input_grad
        dx, dwts, dw_gu, db_gu, dw_d, db_d = moe_backward(
            x, ids, wts, w_gu, b_gu, w_d, b_d, act, interleaved, dy, routing,
            need_dx=need[0], need_weights=any(need[3:7]))
        return dx, None, dwts if need[2] else None, dw_gu, db_gu, dw_d, db_d, None, None


def moe_experts_autograd(x: Tensor, ids: Tensor, wts: Tensor, w_gu: Tensor, b_gu: Tensor | None, w_d: Tensor,
                         b_d: Tensor | None, act: ExpertAct = _SILU, interleaved: bool = False) -> Tensor:
    """y (T, H) as ``moe_experts(..., path="sorted")``, differentiable through the Triton backward."""
    return MoEExpertsFunction.apply(x, ids, wts, w_gu, b_gu, w_d, b_d, act, interleaved)
