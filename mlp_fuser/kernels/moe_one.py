"""A few tokens' routed experts on float8 weights in one kernel: h born on chip, consumed, discarded.

    y[t] = Σ_j w[t, j] · Wd[e]ᵀ A(x[t] @ Wgu[e]ᵀ),   e = ids[t, j] in [0, E) (other ids contribute nothing)

with Wgu (E, 2I or I, H) and Wd (E, H, I) float8_e4m3fn and their scales (``fp8.Fp8Experts``: per 128 × 128 block,
per channel, per tensor, gate and up quantized apart). Program (pair p = t·k + j, slice of BLOCK_I columns of I):
  1. g, u = x[t] · Wg[e][slice]ᵀ, x[t] · Wu[e][slice]ᵀ over K = H in BLOCK_K steps, each float8 tile dequantized in
     registers (W8A16: x keeps its dtype, the products and sums in fp32; a block scale per K step, else one per row
     after the loop);
  2. h = A(g, u) (``moe.gated_act``: GPT-OSS's clamps and up offset too; act(g) for plain experts), rounded to x's
     dtype as the two-launch paths store it (ROUND_H), times the routing weight;
  3. for every BLOCK_N rows of Wd[e] (all of H, the starting chunk rotated per program so that the programs do not
     queue on the same addresses): part = Wd[e][n-block, slice] · h, times the row's scale of the slice's K block,
     ``tl.atomic_add``-ed into an fp32 accumulator (T, H);
  4. a small second launch (stream order: after every atomic) casts the accumulator to y in x's dtype and sets it
     back to 0, so one zeroed buffer kept by the plan serves every call (CUDA-graph replays included: no memset).
Bytes: every touched expert's float8 weights once (Qwen3-30B-A3B, k 8: 8 · 3 · 768 · 2048 = 37.7 MB), x once per
program (L2), the reduction k · ⌈I/BLOCK_I⌉ · T · H fp32 atomics. The atomics' order makes the last bits of the fp32
sum (so at times y's rounding) vary run to run. A slice must lie in one scale block of Wd along I and a K step in
one of Wgu along H: the plan halves BLOCK_I and BLOCK_K until they do. The dispatcher's ``fp8_moe_one_launch`` row
(``dispatch/fp8_experts.py``), timed at a few tokens against the two-launch rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import Prepared, cdiv
from .fp8 import _zeroed_once
from .moe import ExpertAct, _gate_up_layout, _scale_args, gated_act, gemv_step, scale_rows

# a K step of gate/up and an N step of down both move 8 KB of float8 (2·32·128, 256·32): with 4 stages about 24 KB
# in flight per program, 192 programs for Qwen3-30B-A3B (k 8, I 768)
DEFAULT = dict(BLOCK_I=32, BLOCK_K=128, BLOCK_N=256, num_warps=4, num_stages=4)
# wider slices where the grid stays full: fewer atomics (Mixtral-8x7B at one token; NOTES, "One token in one launch")
WIDE = {64: dict(DEFAULT, BLOCK_I=64, BLOCK_N=128), 128: dict(DEFAULT, BLOCK_I=128, BLOCK_N=128, num_warps=8,
                                                                num_stages=3)}
WIDE_PROGRAMS = 200  # a wider slice only while the grid keeps at least this many programs (1.5 an H100's SMs)
SILU = ExpertAct()  # gated silu (SwiGLU), no clamp: the default gate
FINISH_BLOCK = 1024  # accumulator elements per step of the finish


@triton.jit
def _moe_one_kernel(
    x_ptr, ids_ptr, wts_ptr, wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, acc_ptr,
    E, K_TOP, H, I, UP_ROW,
    stride_xt, stride_xk, stride_it, stride_ij, stride_wt, stride_wj,
    stride_ge, stride_gn, stride_gk, stride_sge, stride_sgn, stride_sgk, UP_SOFF, UP_SROW,
    stride_de, stride_dn, stride_dk, stride_sde, stride_sdn, stride_sdk,
    GATED: tl.constexpr, GATE_STEP: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
    CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr,
    G_K_SCALED: tl.constexpr, G_SBN: tl.constexpr, G_SBK: tl.constexpr, D_SBN: tl.constexpr, D_SBK: tl.constexpr,
    ROUND_H: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    # -- pair p = t·k + j, its expert, BLOCK_I columns of h -----------------------------------------------------
    p = tl.program_id(0)
    pid_i = tl.program_id(1)
    t = p // K_TOP
    j = p % K_TOP
    e = tl.load(ids_ptr + t * stride_it + j * stride_ij).to(tl.int64)  # int64: E·2I·H overflows int32
    if (e >= 0) & (e < E):
        offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
        mask_i = offs_i < I
        rows = tl.minimum(offs_i, I - 1) * GATE_STEP  # past I: the last row again (never used)
        offs_k = tl.arange(0, BLOCK_K)

        # -- 1. g and u over K = H, float8 tiles dequantized in registers, fp32 sums ------------------------------
        x_ptrs = x_ptr + t * stride_xt + offs_k * stride_xk
        wg_ptrs = wgu_ptr + e * stride_ge + rows[:, None] * stride_gn + offs_k[None, :] * stride_gk
        wu_ptrs = wg_ptrs + UP_ROW * stride_gn
        sg_ptrs, su_ptrs = scale_rows(sgu_ptr, e, offs_i, I, stride_sge, stride_sgn, GATE_STEP, UP_SOFF, UP_SROW,
                                      G_SBN)
        acc_g = tl.zeros((BLOCK_I,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_I,), dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(H, BLOCK_K), num_stages=STAGES):  # tl.range: else no cp.async pipeline
            k_left = H - k * BLOCK_K
            kmask = offs_k < k_left
            xk = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)[None, :]
            acc_g += gemv_step(wg_ptrs, xk, kmask[None, :], sg_ptrs, k * BLOCK_K, stride_sgk, G_K_SCALED, G_SBK)
            if GATED:
                acc_u += gemv_step(wu_ptrs, xk, kmask[None, :], su_ptrs, k * BLOCK_K, stride_sgk, G_K_SCALED, G_SBK)
            x_ptrs += BLOCK_K * stride_xk
            wg_ptrs += BLOCK_K * stride_gk
            wu_ptrs += BLOCK_K * stride_gk
        if not G_K_SCALED:  # one scale per row (channel, tensor): once
            acc_g = acc_g * tl.load(sg_ptrs)
            if GATED:
                acc_u = acc_u * tl.load(su_ptrs)

        # -- 2. h = A(g, u) in registers, rounded as the two-launch paths store it, times the routing weight -------
        if GATED:
            h = gated_act(acc_g, acc_u, ACT, ALPHA, HAS_LIMIT, LIMIT, CLAMP_AFTER, UP_OFFSET)
        else:
            h = ACT(acc_g)
        if ROUND_H:
            h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
        wt = tl.load(wts_ptr + t * stride_wt + j * stride_wj).to(tl.float32)
        h = tl.where(mask_i, h * wt, 0.0)

        # -- 3. y[t] += Wd[e][:, slice] · h, BLOCK_N rows at a time, fp32 atomics ---------------------------------
        d_base = wd_ptr + e * stride_de + offs_i[None, :] * stride_dk
        sd_base = sd_ptr + e * stride_sde + ((pid_i * BLOCK_I) // D_SBK) * stride_sdk  # the slice's one K block
        n_chunks = tl.cdiv(H, BLOCK_N)
        first = (p * tl.num_programs(1) + pid_i) % n_chunks  # programs start apart: fewer waits on one address
        offs_n0 = tl.arange(0, BLOCK_N)
        acc_row = acc_ptr + t.to(tl.int64) * H
        for c in tl.range(0, n_chunks, num_stages=STAGES):
            nb = (c + first) % n_chunks
            offs_n = nb * BLOCK_N + offs_n0
            mask_n = offs_n < H
            n_rows = tl.minimum(offs_n, H - 1)
            wd = tl.load(d_base + n_rows[:, None] * stride_dn, mask=mask_i[None, :], other=0.0)
            part = tl.sum(wd.to(tl.float32) * h[None, :], axis=1)
            part = part * tl.load(sd_base + (n_rows // D_SBN) * stride_sdn)
            tl.atomic_add(acc_row + offs_n, part, mask=mask_n, sem="relaxed")


@triton.jit
def _moe_one_finish_kernel(acc_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """y = the accumulator in y's dtype, the accumulator set back to 0 (after every program's atomics: stream order)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(acc_ptr + offs, mask=mask, other=0.0).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(acc_ptr + offs, tl.zeros((BLOCK,), dtype=tl.float32), mask=mask)


def one_why_not(fgu, fd) -> str | None:
    """Why the one-launch kernel cannot read these float8 experts' scales, or None: a K step must lie in one scale
    block of gate/up along H and a slice of I in one of down along I, and neither goes below 16."""
    for name, fe in (("w_gate_up", fgu), ("w_down", fd)):
        if fe.k_scaled and fe.block_k % 16:
            return f"{name}'s scale blocks are {fe.block_k} wide along K: the one-launch kernel steps K by 16 or more"
    return None


def one_config(fgu, fd, pairs: int, config: dict | None = None) -> dict:
    """``config``, else the widest slice (``WIDE``, at most I) leaving pairs · ⌈I/BLOCK_I⌉ ≥ WIDE_PROGRAMS, else
    DEFAULT; then BLOCK_K halved until it divides gate/up's scale blocks along H and BLOCK_I until it divides
    down's along I (where they change along K)."""
    I = fd.w.shape[2]
    if config is None:
        config = next((c for bi, c in sorted(WIDE.items(), reverse=True)
                       if bi <= I and pairs * cdiv(I, bi) >= WIDE_PROGRAMS), DEFAULT)
    cfg = dict(DEFAULT, **config)
    if fgu.k_scaled:
        while fgu.block_k % cfg["BLOCK_K"]:
            cfg["BLOCK_K"] //= 2
    if fd.k_scaled:
        while fd.block_k % cfg["BLOCK_I"]:
            cfg["BLOCK_I"] //= 2
    return cfg


def one_plan(x: Tensor, ids: Tensor, wts: Tensor, fgu, fd, act: ExpertAct = SILU, interleaved: bool = False,
             config: dict | None = None, round_h: bool = True):
    """For calls like these (x (T, H), ids and wts (T, k), float8 experts ``fgu`` (E, 2I or I, H) and ``fd``
    (E, H, I), ``fp8.Fp8Experts``): a function ``(x, ids, wts, w_gu, b_gu, w_d, b_d, scales) -> y`` (the experts
    plans' signature; b_gu and b_d None, ``scales`` the call's (gate/up's, down's) Fp8Experts) running the kernel
    and the finish, worked out here once. Its fp32 accumulator is zeroed once and kept (set back to 0 by the
    finish); while a CUDA graph captures the plan's first call, zeroed per call."""
    T, k = ids.shape
    E, H, I = fd.w.shape
    dtype, device = x.dtype, x.device
    if T * k == 0 or H == 0 or I == 0 or E == 0:
        return lambda x, ids, wts, w_gu, b_gu, w_d, b_d, scales: torch.zeros((T, H), dtype=dtype, device=device)
    why = one_why_not(fgu, fd)
    if why is not None:
        raise ValueError(f"mlp_fuser: the one-launch experts kernel cannot run these FP8 weights: {why}")
    gated, step, up_row = _gate_up_layout(fgu.w, I, interleaved)
    cfg = one_config(fgu, fd, T * k, config)
    sgu_args = _scale_args(fgu, up_row)
    sd_args = _scale_args(fd)
    ints = (E, k, H, I, up_row, *x.stride(), *ids.stride(), *wts.stride(), *fgu.w.stride(), *sgu_args[1:],
            *fd.w.stride(), *sd_args[1:4])
    kernel = Prepared(_moe_one_kernel, (T * k, cdiv(I, cfg["BLOCK_I"])),
                      GATED=gated, GATE_STEP=step, **act.constexprs(),
                      G_K_SCALED=fgu.k_scaled, G_SBN=fgu.block_n, G_SBK=fgu.block_k if fgu.k_scaled else 1,
                      D_SBN=fd.block_n, D_SBK=fd.block_k, ROUND_H=round_h,
                      BLOCK_I=cfg["BLOCK_I"], BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"],
                      STAGES=cfg["num_stages"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    n_acc = T * H
    finisher = Prepared(_moe_one_finish_kernel, (cdiv(n_acc, FINISH_BLOCK),), BLOCK=FINISH_BLOCK, num_warps=4)
    kept = _zeroed_once(n_acc, device)  # the fp32 accumulator's bits

    def one(x, ids, wts, w_gu, b_gu, w_d, b_d, scales):
        buf = kept if kept is not None else torch.zeros(n_acc, dtype=torch.int32, device=device)
        acc = buf.view(torch.float32)
        y = torch.empty((T, H), dtype=dtype, device=device)
        kernel(x, ids, wts, w_gu, scales[0].scale, w_d, scales[1].scale, acc, *ints)
        finisher(acc, y, n_acc)
        return y
    return one


def moe_one(x: Tensor, ids: Tensor, wts: Tensor, fgu, fd, act: ExpertAct = SILU, interleaved: bool = False,
            config: dict | None = None, round_h: bool = True) -> Tensor:
    """y (T, H) in x's dtype by the one-launch kernel (``one_plan`` for this call alone)."""
    plan = one_plan(x, ids, wts, fgu, fd, act, interleaved, config, round_h)
    return plan(x, ids, wts, fgu.w, None, fd.w, None, (fgu, fd))
