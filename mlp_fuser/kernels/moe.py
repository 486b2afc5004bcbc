"""Routed experts: y[t] = Σ_j w[t, j] · expert_{ids[t, j]}(x[t]), ids outside [0, E) contributing nothing.

An expert is o = A(x @ Wgu[e]ᵀ + bgu[e]) @ Wd[e]ᵀ + bd[e] with Wgu[e] (2I, H) gated (gate|up concatenated, or
interleaved as GPT-OSS stores it), (I, H) plain, and Wd[e] (H, I); weights are read through their strides, never
copied. The ways through it (PATHS), each without host syncs (CUDA-graph safe):

- sorted: ``moe_align`` groups the pairs by expert in BLOCK_M-row blocks; ``moe_gate_up`` runs one tile
  GEMM per (block, BLOCK_N) over gathered x rows with the activation in its epilogue and writes h per pair;
  ``moe_down`` multiplies h into Wd[e] with the bias and routing weight in its epilogue (fp32 per pair), and
  ``moe_combine`` sums each token's k rows in j order. sorted_fused: ``moe_down_combine`` does that sum in the
  down kernel, by the last of a token's pairs to finish its n-block (an atomic counter per token and n-block).
- unsorted (one token): the same two kernels with every pair its own block (``routing`` None), so no moe_align.
- pairs (decode, few tokens): ``moe_gate_up_pairs`` is a GEMV per pair that streams its expert's gate/up rows once;
  ``moe_down_tokens`` is a GEMV per token over its k experts, the weighted sum kept in registers, y stored once.
- sorted_tma: the sorted path with each expert's weight tiles loaded through host TMA descriptors over the stacked
  weights (``tma_why_not`` says where they cannot be: then the pointer loads); for many rows per expert.
- sorted_fused and unsorted also as "<path>_nomemset" (the gate/up kernel zeroes the combine's counters: no memset
  launch) and "<path>_pdl" (that, with the down kernel launched by programmatic dependent launch on Hopper: its
  prologue overlaps gate/up's tail, ``gdc_wait`` before it reads h or the counters).

All accumulation is fp32; h is rounded to x's dtype once, y once. Results are deterministic: the counters only pick
which program sums a token's rows, never the order of the sum.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover (the tested Tritons have them)
    TensorDescriptor = None

from .. import config as _config
from ..activations import get_activation
from . import moe_tuning
from .common import INTERPRET, Prepared, cdiv, dot_precision, k_loop_fits, kept_desc, launch, next_power_of_2, num_sms
from .fp8 import A8_BLOCK, FP8, _quantize_plan, _x_step, check_a8, quantize_rows, quantize_tile
from .gemm import gate_up_acc
from .moe_routing import Routing, align_plan, max_blocks, moe_align
from .moe_tuning import _cfg

__all__ = ["ExpertAct", "moe_align", "moe_gate_up", "moe_down", "moe_down_combine", "moe_combine", "moe_gate_up_pairs",
           "moe_down_tokens", "moe_experts", "experts_plan", "moe_reference", "default_config", "combine_counts",
           "has_pdl", "tma_why_not", "tma_shape_why_not", "CONFIGS", "PATHS", "Routing"]


@dataclass(frozen=True)
class ExpertAct:
    """The experts' activation. Gated: h = A(g, u) as ``gated_act`` computes it; plain: h = act(gu)."""
    name: str = "silu"  # a registry activation (unused where alpha != 0)
    alpha: float = 0.0  # != 0: a = g · sigmoid(alpha · g) (GPT-OSS: 1.702)
    limit: float | None = None  # clamp g from above and u both ways at this value
    clamp_after: bool = False  # clamp act(g) rather than g
    up_offset: float = 0.0  # h = a · (u + up_offset) (GPT-OSS: 1.0)

    def torch_gated(self, g: Tensor, u: Tensor) -> Tensor:
        """A(g, u) in torch ops (the reference's), on fp32 or fp64 values."""
        if self.limit is not None and not self.clamp_after:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        a = g * torch.sigmoid(self.alpha * g) if self.alpha != 0 else get_activation(self.name).fn(g)
        if self.limit is not None and self.clamp_after:
            a, u = a.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return a * (u + self.up_offset)

    def constexprs(self) -> dict:
        return _constexprs(self)


@functools.lru_cache(maxsize=256)
def _constexprs(act: ExpertAct) -> dict:
    return dict(ACT=get_activation(act.name).triton_fn, ALPHA=float(act.alpha), HAS_LIMIT=act.limit is not None,
                LIMIT=float(act.limit or 0.0), CLAMP_AFTER=act.clamp_after, UP_OFFSET=float(act.up_offset))


@triton.jit
def gated_act(g, u, ACT: tl.constexpr, ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
              CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr):
    """h = A(g, u) in fp32: the clamps (before or after the activation), ACT or g·σ(ALPHA·g), times (u + UP_OFFSET)."""
    if HAS_LIMIT and not CLAMP_AFTER:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    if ALPHA != 0.0:
        a = g * tl.sigmoid(ALPHA * g)
    else:
        a = ACT(g)
    if HAS_LIMIT and CLAMP_AFTER:
        a = tl.minimum(a, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    return a * (u + UP_OFFSET)


@triton.jit
def add_gate_up_bias(acc_g, acc_u, b_ptr, e, offs_n, mask_n, stride_be, stride_bn, UP_ROW,
                     GATED: tl.constexpr, GATE_STEP: tl.constexpr):
    """acc_g and acc_u plus the biases of expert e: gate at row GATE_STEP·n, up at UP_ROW + GATE_STEP·n."""
    b_base = b_ptr + e * stride_be
    acc_g += tl.load(b_base + offs_n * GATE_STEP * stride_bn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        b_up = b_base + (UP_ROW + offs_n * GATE_STEP) * stride_bn
        acc_u += tl.load(b_up, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return acc_g, acc_u


@triton.jit
def expert_epilogue(acc_g, acc_u, b_ptr, e, offs_n, mask_n, stride_be, stride_bn, UP_ROW,
                    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, GATE_STEP: tl.constexpr,
                    ACT: tl.constexpr, ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
                    CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr):
    """Biases of expert e (``add_gate_up_bias``), then A(g, u) or act(g), in fp32."""
    if HAS_BIAS:
        acc_g, acc_u = add_gate_up_bias(acc_g, acc_u, b_ptr, e, offs_n, mask_n, stride_be, stride_bn, UP_ROW,
                                        GATED, GATE_STEP)
    if GATED:
        return gated_act(acc_g, acc_u, ACT, ALPHA, HAS_LIMIT, LIMIT, CLAMP_AFTER, UP_OFFSET)
    return ACT(acc_g)


@triton.jit
def fp8_gate_up_acc(
    x_ptr, wg_ptr, wu_ptr, sg_ptrs, su_ptrs, xs_ptr, stride_xs, offs_m, offs_n, mask_m, mask_n, K,
    stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk, stride_sk,
    HAS_UP: tl.constexpr, K_SCALED: tl.constexpr, SBK: tl.constexpr, A8: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QUANT_X: tl.constexpr,
):
    """``gemm.gate_up_acc`` on float8 weights. W8A16: each weight tile cast to x's dtype in registers; W8A8 (A8): x
    is float8 too (quantized per row and 128 columns, ``xs_ptrs``: each row's scales) and the fp8 tensor cores
    multiply, x's scale per K step (BLOCK_K divides 128; ``xs_ptr``: x's (rows, ⌈K/128⌉) scales, row stride
    ``stride_xs``); with QUANT_X (BLOCK_K 128) x comes in its own dtype and each step quantizes its tile
    (``fp8._x_step``: quantize_rows' bits), no ``xs_ptr``. The weight rows' scales (``sg_ptrs``/``su_ptrs``: column 0
    of each row's scale row) multiply each K step's product where they change along K (K_SCALED; BLOCK_K divides
    SBK), else the whole sum once."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    wg_ptrs = wg_ptr + offs_k[:, None] * stride_wgk + offs_n[None, :] * stride_wgn
    wu_ptrs = wu_ptr + offs_k[:, None] * stride_wuk + offs_n[None, :] * stride_wun

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if A8 and not QUANT_X:
        xs_ptrs = xs_ptr + offs_m * stride_xs
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x, xs = _x_step(x_ptrs, offs_k < k_left, mask_m, QUANT_X)
        w_mask = (offs_k[:, None] < k_left) & mask_n[None, :]
        if QUANT_X:  # this step's x scales, one per row: the quantization's own
            xs = xs[:, None]
        elif A8:  # quantize_rows' scales
            xs = tl.load(xs_ptrs + k * BLOCK_K // 128, mask=mask_m, other=0.0)[:, None]
        wg = tl.load(wg_ptrs, mask=w_mask, other=0.0)
        if A8:
            acc_g += a8_part(tl.dot(x, wg), xs, sg_ptrs, k * BLOCK_K, stride_sk, K_SCALED, SBK)
        elif K_SCALED:
            s_k = (k * BLOCK_K // SBK) * stride_sk
            acc_g += tl.dot(x, wg.to(x.dtype), input_precision=PRECISION) * tl.load(sg_ptrs + s_k)[None, :]
        else:
            acc_g = tl.dot(x, wg.to(x.dtype), acc_g, input_precision=PRECISION)
        if HAS_UP:
            wu = tl.load(wu_ptrs, mask=w_mask, other=0.0)
            if A8:
                acc_u += a8_part(tl.dot(x, wu), xs, su_ptrs, k * BLOCK_K, stride_sk, K_SCALED, SBK)
            elif K_SCALED:
                acc_u += tl.dot(x, wu.to(x.dtype), input_precision=PRECISION) * tl.load(su_ptrs + s_k)[None, :]
            else:
                acc_u = tl.dot(x, wu.to(x.dtype), acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wgk
        wu_ptrs += BLOCK_K * stride_wuk
    return row_scaled(acc_g, acc_u, sg_ptrs, su_ptrs, HAS_UP, K_SCALED)


@triton.jit
def a8_part(part, xs, s_ptrs, k_off, stride_sk, K_SCALED: tl.constexpr, SBK: tl.constexpr,
            WS_TILE: tl.constexpr = False):
    """One W8A8 K step's fp8 product (fp32) at K offset ``k_off`` times x's rows' scales ``xs`` (BLOCK_M, 1) and,
    where the weight's scales change along K (K_SCALED), its rows' scales of that K block (``s_ptrs``: column 0 of
    each row's scale row, ``scale_rows``; WS_TILE: one pointer, every column of the tile in one scale block, so the
    two scales meet per row first and the step costs one multiply-add an element)."""
    if K_SCALED:
        ws = tl.load(s_ptrs + (k_off // SBK) * stride_sk)
        if WS_TILE:
            return part * (xs * ws)
        return part * (xs * ws[None, :])  # the scales' product first, as WS_TILE: the same bits
    return part * xs


@triton.jit
def row_scaled(acc_g, acc_u, sg_ptrs, su_ptrs, HAS_UP: tl.constexpr, K_SCALED: tl.constexpr):
    """The float8 accumulators after the K loop: times their rows' one scale where it does not change along K."""
    if not K_SCALED:
        acc_g = acc_g * tl.load(sg_ptrs)[None, :]
        if HAS_UP:
            acc_u = acc_u * tl.load(su_ptrs)[None, :]
    return acc_g, acc_u


@triton.jit
def scale_rows(s_ptr, e, offs_n, N, stride_se, stride_sn, GATE_STEP: tl.constexpr, UP_SOFF, UP_SROW,
               SBN: tl.constexpr):
    """Pointers to column 0 of the scale rows of expert e's gate rows GATE_STEP·n and up rows (scale row
    UP_SOFF + (UP_SROW + GATE_STEP·n) // SBN), for the columns offs_n of h (past N: the last one's)."""
    rows = tl.minimum(offs_n, N - 1) * GATE_STEP
    s_e = s_ptr + e * stride_se
    return s_e + (rows // SBN) * stride_sn, s_e + (UP_SOFF + (UP_SROW + rows) // SBN) * stride_sn


# ---- sorted path: grouped GEMMs over BLOCK_M-row blocks of one expert each ---------------------------


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, b_ptr, h_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
    S, K_TOP, N, K, UP_ROW,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_bn,
    s_ptr, stride_se, stride_sn, stride_sk, UP_SOFF, UP_SROW, xs_ptr, stride_xs,
    ids_ptr, E, stride_it, stride_ij, count_ptr, N_COUNTS, gu_ptr,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, GATE_STEP: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
    CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_PAIR: tl.constexpr,
    ZERO_COUNTS: tl.constexpr, BLOCK_C: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
    FP8: tl.constexpr, K_SCALED: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, A8: tl.constexpr,
    QUANT_X: tl.constexpr, SAVE_GU: tl.constexpr, PAIRED: tl.constexpr = False,
):
    # -- this program's block of pairs (one expert) and BLOCK_N columns of h ------------------------
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if ZERO_COUNTS:  # the down kernel's combine counters, BLOCK_C per program, before any early return
        n_programs = tl.num_programs(0) * tl.num_programs(1)
        offs_c = pid_b * tl.num_programs(1) + pid_n + n_programs * tl.arange(0, BLOCK_C)
        tl.store(count_ptr + offs_c, tl.zeros((BLOCK_C,), dtype=tl.int32), mask=offs_c < N_COUNTS)
    if LAUNCH_DEPENDENTS:  # the down kernel may start its prologue now; its gdc_wait waits for all of this one
        gdc_launch_dependents()
    if PER_PAIR:  # no routing: program b is pair b alone, the tile's other rows masked off
        e = tl.load(ids_ptr + (pid_b // K_TOP) * stride_it + (pid_b % K_TOP) * stride_ij).to(tl.int64)
        if (e < 0) | (e >= E):
            return
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_b, S)
    else:
        if pid_b >= tl.load(num_blocks_ptr):
            return
        e = tl.load(block_expert_ptr + pid_b).to(tl.int64)  # int64: E·2I·H overflows int32 (DeepSeek-V3)
        pairs = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < S
    tokens = pairs // K_TOP  # x rows gathered per pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N

    # -- gate and up tiles of expert e from one gathered x tile, two fp32 accumulators ---------------
    w_e = w_ptr + e * stride_we
    if FP8:  # float8 weights: each tile cast in registers, the expert's scales per K step or once
        sg_ptrs, su_ptrs = scale_rows(s_ptr, e, offs_n, N, stride_se, stride_sn, GATE_STEP, UP_SOFF, UP_SROW, SBN)
        acc_g, acc_u = fp8_gate_up_acc(
            x_ptr, w_e, w_e + UP_ROW * stride_wn, sg_ptrs, su_ptrs, xs_ptr, stride_xs, tokens, offs_n,
            mask_m, mask_n, K, stride_xm, stride_xk, GATE_STEP * stride_wn, stride_wk, GATE_STEP * stride_wn,
            stride_wk, stride_sk, GATED, K_SCALED, SBK, A8, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, QUANT_X,
        )
    elif PAIRED:  # gate and up rows interleaved along the weight's contiguous dim: one (BLOCK_K, 2·BLOCK_N) tile a
        # K step where two strided tiles would read every other element; the columns split into gate and up after
        offs_r = 2 * pid_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        acc, _ = gate_up_acc(x_ptr, w_e, w_e, tokens, offs_r, mask_m, offs_r < 2 * N, K, stride_xm, stride_xk,
                             stride_wn, stride_wk, stride_wn, stride_wk, False, PRECISION, BLOCK_M, 2 * BLOCK_N,
                             BLOCK_K)
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:
        acc_g, acc_u = gate_up_acc(
            x_ptr, w_e, w_e + UP_ROW * stride_wn, tokens, offs_n, mask_m, mask_n, K,
            stride_xm, stride_xk, GATE_STEP * stride_wn, stride_wk, GATE_STEP * stride_wn, stride_wk,
            GATED, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )
    h = kept_or_not(acc_g, acc_u, gu_ptr, pairs, mask_m, b_ptr, e, offs_n, mask_n, stride_be, stride_bn, N, UP_ROW,
                    GATED, HAS_BIAS, GATE_STEP, ACT, ALPHA, HAS_LIMIT, LIMIT, CLAMP_AFTER, UP_OFFSET, SAVE_GU,
                    pid_n * BLOCK_N, BLOCK_M, BLOCK_N)
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def kept_or_not(acc_g, acc_u, gu_ptr, pairs, mask_m, b_ptr, e, offs_n, mask_n, stride_be, stride_bn, N, UP_ROW,
                GATED: tl.constexpr, HAS_BIAS: tl.constexpr, GATE_STEP: tl.constexpr, ACT: tl.constexpr,
                ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr, CLAMP_AFTER: tl.constexpr,
                UP_OFFSET: tl.constexpr, SAVE_GU: tl.constexpr, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """h in fp32 from gate/up's accumulators; with SAVE_GU (training, backward "save") g and u with their biases
    first stored per pair (``store_gu``; ``offs_n`` = col0 + arange(BLOCK_N)), rounded as stored, and h computed from
    those."""
    if SAVE_GU:
        if HAS_BIAS:
            acc_g, acc_u = add_gate_up_bias(acc_g, acc_u, b_ptr, e, offs_n, mask_n, stride_be, stride_bn, UP_ROW,
                                            GATED, GATE_STEP)
        g = acc_g.to(gu_ptr.dtype.element_ty)
        u = acc_u.to(gu_ptr.dtype.element_ty)
        n_gu = 2 * N if GATED else N
        store_gu(gu_ptr, pairs.to(tl.int64), g, u, offs_n, mask_m[:, None] & mask_n[None, :], n_gu, UP_ROW, GATED,
                 GATE_STEP, mask_m, col0, BLOCK_M, BLOCK_N)
        return expert_epilogue(g.to(tl.float32), u.to(tl.float32), b_ptr, e, offs_n, mask_n, stride_be, stride_bn,
                               UP_ROW, GATED, False, GATE_STEP, ACT, ALPHA, HAS_LIMIT, LIMIT, CLAMP_AFTER, UP_OFFSET)
    return expert_epilogue(acc_g, acc_u, b_ptr, e, offs_n, mask_n, stride_be, stride_bn, UP_ROW, GATED, HAS_BIAS,
                           GATE_STEP, ACT, ALPHA, HAS_LIMIT, LIMIT, CLAMP_AFTER, UP_OFFSET)


@triton.jit
def pair_cols(mask_m, col0, N_GU, BLOCK_N: tl.constexpr):
    """The contiguous columns 2·col0 .. 2·col0 + 2·BLOCK_N of a row layout with gate and up interleaved, and their
    mask for rows ``mask_m``."""
    cols = 2 * col0 + tl.arange(0, 2 * BLOCK_N)
    return cols, mask_m[:, None] & (cols < N_GU)[None, :]


@triton.jit
def store_gu(ptr, rows, g, u, offs_n, mask, N_GU, UP_ROW, GATED: tl.constexpr, GATE_STEP: tl.constexpr,
             mask_m, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """g (and u) stored in Wgu's row layout at ``rows`` of a (rows, N_GU) tensor: gate column GATE_STEP·n, up
    UP_ROW + GATE_STEP·n (``offs_n`` = col0 + arange(BLOCK_N)). Gate and up interleaved (GATE_STEP 2): joined in
    registers and stored as one contiguous (BLOCK_M, 2·BLOCK_N) tile, the same values at the same addresses as two
    scalar stores of every other element (GPT-OSS, T = 8192, H200: the backward's act kernel took 6.8 ms with those,
    5.0 without storing [dg du] at all; the forward's gate/up kernel keeping g and u 3.9 ms, 2.0 without)."""
    base = ptr + rows[:, None] * N_GU
    if GATED and GATE_STEP == 2:
        cols, mask2 = pair_cols(mask_m, col0, N_GU, BLOCK_N)
        tl.store(base + cols[None, :], tl.reshape(tl.join(g, u), (BLOCK_M, 2 * BLOCK_N)), mask=mask2)
    else:
        tl.store(base + (offs_n * GATE_STEP)[None, :], g, mask=mask)
        if GATED:
            tl.store(base + (UP_ROW + offs_n * GATE_STEP)[None, :], u, mask=mask)


@triton.jit
def load_gu(ptr, rows, offs_n, mask, N_GU, UP_ROW, GATED: tl.constexpr, GATE_STEP: tl.constexpr,
            mask_m, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(g, u) in fp32 from Wgu's row layout at ``rows`` (``store_gu``'s); u zero without GATED. Interleaved: one
    contiguous (BLOCK_M, 2·BLOCK_N) tile, split in registers."""
    base = ptr + rows[:, None] * N_GU
    if GATED and GATE_STEP == 2:
        cols, mask2 = pair_cols(mask_m, col0, N_GU, BLOCK_N)
        gu = tl.load(base + cols[None, :], mask=mask2, other=0.0).to(tl.float32)
        g, u = tl.split(tl.reshape(gu, (BLOCK_M, BLOCK_N, 2)))
    else:
        g = tl.load(base + (offs_n * GATE_STEP)[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.zeros_like(g)
        if GATED:
            u = tl.load(base + (UP_ROW + offs_n * GATE_STEP)[None, :], mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def valid_pairs(ids_ptr, tokens, mask, E, K_TOP, stride_it, stride_ij, BLOCK_J: tl.constexpr):
    """Per token of ``tokens``: how many of its K_TOP ids are in [0, E) (0 where ``mask`` is off)."""
    offs_j = tl.arange(0, BLOCK_J)
    e = tl.load(ids_ptr + tokens[:, None] * stride_it + offs_j[None, :] * stride_ij,
                mask=mask[:, None] & (offs_j[None, :] < K_TOP), other=-1)
    return tl.sum(((e >= 0) & (e < E)).to(tl.int32), axis=1)


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, b_ptr, wts_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
    S, K_TOP, N, K,
    stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_wt, stride_wj,
    s_ptr, stride_se, stride_sn, stride_sk, UP_SOFF, UP_SROW, xs_ptr, stride_xs,
    ids_ptr, y_ptr, count_ptr, E, stride_it, stride_ij, stride_yt,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PER_PAIR: tl.constexpr, COMBINE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr,
    USE_PDL: tl.constexpr, FP8: tl.constexpr, K_SCALED: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
    A8: tl.constexpr, QUANT_X: tl.constexpr,
):
    # -- this program's block of pairs (one expert) and BLOCK_N columns of the output ---------------
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if COMBINE:  # tokens with no valid pair are in no block: y = 0 for tokens b, b + grid, ... (BLOCK_T of them)
        T = S // K_TOP
        offs_t = pid_b + tl.num_programs(0) * tl.arange(0, BLOCK_T)
        none = (offs_t < T) & (valid_pairs(ids_ptr, offs_t, offs_t < T, E, K_TOP, stride_it, stride_ij, BLOCK_J) == 0)
        offs_y = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        zero_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_y[None, :]
        tl.store(zero_ptrs, tl.zeros((BLOCK_T, BLOCK_N), dtype=y_ptr.dtype.element_ty),
                 mask=none[:, None] & (offs_y < N)[None, :])
    if PER_PAIR:  # no routing: program b is pair b alone, the tile's other rows masked off
        e = tl.load(ids_ptr + (pid_b // K_TOP) * stride_it + (pid_b % K_TOP) * stride_ij).to(tl.int64)
        if (e < 0) | (e >= E):
            return
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_b, S)
    else:
        if pid_b >= tl.load(num_blocks_ptr):
            return
        e = tl.load(block_expert_ptr + pid_b).to(tl.int64)
        pairs = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < S
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if USE_PDL:  # launched while gate_up runs: what it does not write is loaded before waiting for all of it
        if HAS_BIAS:
            bias = tl.load(b_ptr + e * stride_be + offs_n * stride_bn, mask=mask_n, other=0.0).to(tl.float32)
        wts = tl.load(wts_ptr + (pairs // K_TOP) * stride_wt + (pairs % K_TOP) * stride_wj, mask=mask_m, other=0.0)
        gdc_wait()  # h and the counters (zeroed by gate_up) only after this

    # -- h rows of the pairs (K = I columns) times Wd[e]ᵀ -------------------------------------------
    w_e = w_ptr + e * stride_we
    if FP8:
        s_rows, _ = scale_rows(s_ptr, e, offs_n, N, stride_se, stride_sn, 1, 0, 0, SBN)
        acc, _ = fp8_gate_up_acc(
            h_ptr, w_e, w_e, s_rows, s_rows, xs_ptr, stride_xs, pairs.to(tl.int64), offs_n,
            mask_m, mask_n, K, K, 1, stride_wn, stride_wk, stride_wn, stride_wk, stride_sk,
            False, K_SCALED, SBK, A8, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, QUANT_X,
        )
    else:
        acc, _ = gate_up_acc(
            h_ptr, w_e, w_e, pairs.to(tl.int64), offs_n, mask_m, mask_n, K,
            K, 1, stride_wn, stride_wk, stride_wn, stride_wk,
            False, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )

    # -- epilogue: bias, routing weight; one fp32 row per pair --------------------------------------
    if HAS_BIAS:
        if not USE_PDL:
            bias = tl.load(b_ptr + e * stride_be + offs_n * stride_bn, mask=mask_n, other=0.0).to(tl.float32)
        acc += bias[None, :]
    if not USE_PDL:
        wts = tl.load(wts_ptr + (pairs // K_TOP) * stride_wt + (pairs % K_TOP) * stride_wj, mask=mask_m, other=0.0)
    acc = acc * wts.to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])

    if COMBINE:
        # -- count each pair's (token, n-block) in; its last arriver sums the token's rows -----------
        tokens = pairs // K_TOP
        k_valid = valid_pairs(ids_ptr, tokens, mask_m, E, K_TOP, stride_it, stride_ij, BLOCK_J)
        tl.debug_barrier()  # every thread's rows stored before any of this program's counts
        old = tl.atomic_add(count_ptr + tokens * tl.num_programs(1) + pid_n, 1, mask=mask_m)
        last = mask_m & (old == k_valid - 1)
        if tl.sum(last.to(tl.int32)) > 0:
            tl.debug_barrier()  # the counts read before any thread reads the other programs' rows
            y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in range(0, K_TOP):  # in j order, whoever arrived last: deterministic
                e_j = tl.load(ids_ptr + tokens * stride_it + j * stride_ij, mask=last, other=-1)
                ok = last & (e_j >= 0) & (e_j < E)  # the rows of dropped pairs were never written
                row = out_ptr + (tokens * K_TOP + j)[:, None].to(tl.int64) * N + offs_n[None, :]
                y += tl.load(row, mask=ok[:, None] & mask_n[None, :], other=0.0, cache_modifier=".cg")
            y_ptrs = y_ptr + tokens[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=last[:, None] & mask_n[None, :])


@triton.jit
def _moe_combine_kernel(
    out_ptr, rows_ptr, ids_ptr, y_ptr, E, N, stride_it, stride_ij, stride_yt,
    K_TOP: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    # -- y[t, n-block] = Σ_j out[row of pair t·k + j] over the valid j, in j order ------------------------
    # (the row is t·k + j, or with HAS_ROWS rows[t·k + j]: a compact sorted order's)
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(K_TOP):
        e = tl.load(ids_ptr + t * stride_it + j * stride_ij)
        ok = (e >= 0) & (e < E)  # the rows of dropped pairs were never written
        if HAS_ROWS:
            pair = tl.load(rows_ptr + t * K_TOP + j, mask=ok, other=0).to(tl.int64)
        else:
            pair = (t * K_TOP + j).to(tl.int64)
        acc += tl.load(out_ptr + pair * N + offs_n, mask=mask_n & ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * stride_yt + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


# ---- sorted path, weights through TMA: each expert's tiles as boxes of the stacked (E·rows, K) weights ---------


@triton.jit
def _moe_gate_up_tma_kernel(
    x_ptr, w_desc, b_ptr, h_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
    S, K_TOP, N, K, UP_ROW, ROWS, stride_xm, stride_xk, stride_be, stride_bn, gu_ptr,
    s_ptr, stride_se, stride_sn, stride_sk, UP_SOFF, UP_SROW, xs_ptr, stride_xs, hs_ptr, stride_hs,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
    CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SAVE_GU: tl.constexpr = False,
    A8: tl.constexpr = False, K_SCALED: tl.constexpr = False, SBN: tl.constexpr = 1, SBK: tl.constexpr = 1,
    WS_TILE: tl.constexpr = False, QUANT_H: tl.constexpr = False, H_ROUND: tl.constexpr = tl.float32,
):
    # -- one expert's BLOCK_M sorted pairs, BLOCK_N columns of h ----------------------------------
    # (A8: x float8 with its scales per row and 128 columns at xs_ptr, the weight float8 with its scales at s_ptr as
    # the pointer kernel's FP8 branch reads them, each K step's product scaled as there: ``a8_part``)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_b >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + pid_b)
    pairs = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < S
    tokens = pairs // K_TOP
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    # gate rows e·ROWS + n, up rows e·ROWS + UP_ROW + n: a box past the expert's rows only feeds masked columns
    row_g = e * ROWS + pid_n * BLOCK_N
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if A8:  # the expert's scale rows for these columns (WS_TILE: the tile's one), x's rows' scales
        cols = pid_n * BLOCK_N if WS_TILE else offs_n
        sg_ptrs, su_ptrs = scale_rows(s_ptr, e.to(tl.int64), cols, N, stride_se, stride_sn, 1, UP_SOFF, UP_SROW, SBN)
        xs_ptrs = xs_ptr + tokens * stride_xs

    # -- x gathered by pointer, weight boxes by TMA (zero past K), two fp32 accumulators -----------
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k), other=0.0)
        if A8:
            xs = tl.load(xs_ptrs + k // 128, mask=mask_m, other=0.0)[:, None]
            acc_g += a8_part(tl.dot(x, w_desc.load([row_g, k]).T), xs, sg_ptrs, k, stride_sk, K_SCALED, SBK,
                             WS_TILE)
            if GATED:
                acc_u += a8_part(tl.dot(x, w_desc.load([row_g + UP_ROW, k]).T), xs, su_ptrs, k, stride_sk,
                                 K_SCALED, SBK, WS_TILE)
        else:
            acc_g = tl.dot(x, w_desc.load([row_g, k]).T, acc_g, input_precision=PRECISION)
            if GATED:
                acc_u = tl.dot(x, w_desc.load([row_g + UP_ROW, k]).T, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
    if A8:
        acc_g, acc_u = row_scaled(acc_g, acc_u, sg_ptrs, su_ptrs, GATED, K_SCALED)

    h = kept_or_not(acc_g, acc_u, gu_ptr, pairs, mask_m, b_ptr, e.to(tl.int64), offs_n, mask_n, stride_be, stride_bn,
                    N, UP_ROW, GATED, HAS_BIAS, 1, ACT, ALPHA, HAS_LIMIT, LIMIT, CLAMP_AFTER, UP_OFFSET, SAVE_GU,
                    pid_n * BLOCK_N, BLOCK_M, BLOCK_N)
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * N + offs_n[None, :]
    if QUANT_H:  # h float8 for down: rounded to H_ROUND as stored unfused, then quantize_rows' math (BLOCK_N: 128)
        h, scale = quantize_tile(tl.where(mask_n[None, :], h.to(H_ROUND).to(tl.float32), 0.0))
        tl.store(hs_ptr + pairs.to(tl.int64) * stride_hs + pid_n, scale, mask=mask_m)
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_tma_kernel(
    h_ptr, w_desc, b_ptr, wts_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
    S, K_TOP, N, K, stride_be, stride_bn, stride_wt, stride_wj,
    s_ptr, stride_se, stride_sn, stride_sk, xs_ptr, stride_xs,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A8: tl.constexpr = False, K_SCALED: tl.constexpr = False, SBN: tl.constexpr = 1, SBK: tl.constexpr = 1,
    WS_TILE: tl.constexpr = False,
):
    # -- one expert's BLOCK_M sorted pairs, BLOCK_N columns of the output -------------------------
    # (A8: h float8, scaled as in the gate/up kernel)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_b >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + pid_b)
    pairs = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < S
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * K + offs_k[None, :]
    row_w = e * N + pid_n * BLOCK_N  # rows of Wd[e] in the (E·H, I) view
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if A8:
        s_rows, _ = scale_rows(s_ptr, e.to(tl.int64), pid_n * BLOCK_N if WS_TILE else offs_n, N, stride_se,
                               stride_sn, 1, 0, 0, SBN)
        xs_ptrs = xs_ptr + pairs * stride_xs

    # -- h rows by pointer, Wd[e] boxes by TMA ---------------------------------------------------
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        h = tl.load(h_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k), other=0.0)
        if A8:
            xs = tl.load(xs_ptrs + k // 128, mask=mask_m, other=0.0)[:, None]
            acc += a8_part(tl.dot(h, w_desc.load([row_w, k]).T), xs, s_rows, k, stride_sk, K_SCALED, SBK, WS_TILE)
        else:
            acc = tl.dot(h, w_desc.load([row_w, k]).T, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K
    if A8:
        acc, _ = row_scaled(acc, acc, s_rows, s_rows, False, K_SCALED)

    # -- epilogue: bias, routing weight; one fp32 row per pair --------------------------------------
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + offs_n * stride_bn, mask=mask_n,
                       other=0.0).to(tl.float32)[None, :]
    wts = tl.load(wts_ptr + (pairs // K_TOP) * stride_wt + (pairs % K_TOP) * stride_wj, mask=mask_m, other=0.0)
    acc = acc * wts.to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


# ---- pairs path: a GEMV per pair, then per token ---------------------------------------------------


@triton.jit
def gemv_step(w_ptrs, x, w_mask, s_ptrs, k_off, stride_sk, K_SCALED: tl.constexpr, SBK: tl.constexpr):
    """One K step of a GEMV on a (BLOCK_N, BLOCK_K) weight tile (bf16, or float8 cast in registers): each row's fp32
    sum of w · x (x (1, BLOCK_K) fp32), times the row's scale of the K block at ``k_off`` where the scales change along
    K (``s_ptrs``: ``scale_rows``'; BLOCK_K divides SBK)."""
    part = tl.sum(tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x, axis=1)
    if K_SCALED:
        part = part * tl.load(s_ptrs + (k_off // SBK) * stride_sk)
    return part


@triton.jit
def _moe_gate_up_pairs_kernel(
    x_ptr, ids_ptr, w_ptr, b_ptr, h_ptr,
    E, K_TOP, N, K, UP_ROW,
    stride_xm, stride_xk, stride_it, stride_ij, stride_we, stride_wn, stride_wk, stride_be, stride_bn,
    s_ptr, stride_se, stride_sn, stride_sk, UP_SOFF, UP_SROW,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, GATE_STEP: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
    CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, K_SCALED: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
):
    # -- pair p = t·k + j, its expert, BLOCK_N columns of h ------------------------------------------
    p = tl.program_id(0)
    t = p // K_TOP
    e = tl.load(ids_ptr + t * stride_it + (p % K_TOP) * stride_ij).to(tl.int64)
    if (e < 0) | (e >= E):
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    # -- stream the gate and up rows (BLOCK_N, BLOCK_K) once, products summed over K in fp32 ----------
    x_ptrs = x_ptr + t * stride_xm + offs_k * stride_xk
    wg_ptrs = w_ptr + e * stride_we + (offs_n * GATE_STEP)[:, None] * stride_wn + offs_k[None, :] * stride_wk
    wu_ptrs = wg_ptrs + UP_ROW * stride_wn
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if FP8:  # float8 weights (cast in registers below): the expert's scale rows
        sg_ptrs, su_ptrs = scale_rows(s_ptr, e, offs_n, N, stride_se, stride_sn, GATE_STEP, UP_SOFF, UP_SROW, SBN)
    else:  # never read (K_SCALED is off)
        sg_ptrs, su_ptrs = s_ptr, s_ptr
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=offs_k < k_left, other=0.0).to(tl.float32)[None, :]
        w_mask = mask_n[:, None] & (offs_k[None, :] < k_left)
        acc_g += gemv_step(wg_ptrs, x, w_mask, sg_ptrs, k * BLOCK_K, stride_sk, K_SCALED, SBK)
        if GATED:
            acc_u += gemv_step(wu_ptrs, x, w_mask, su_ptrs, k * BLOCK_K, stride_sk, K_SCALED, SBK)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
    if FP8 and not K_SCALED:  # a scale per row: once
        acc_g = acc_g * tl.load(sg_ptrs)
        if GATED:
            acc_u = acc_u * tl.load(su_ptrs)

    h = expert_epilogue(acc_g[None, :], acc_u[None, :], b_ptr, e, offs_n, mask_n, stride_be, stride_bn, UP_ROW,
                        GATED, HAS_BIAS, GATE_STEP, ACT, ALPHA, HAS_LIMIT, LIMIT, CLAMP_AFTER, UP_OFFSET)
    h_ptrs = h_ptr + p.to(tl.int64) * N + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask_n[None, :])


@triton.jit
def _moe_down_tokens_kernel(
    h_ptr, ids_ptr, wts_ptr, w_ptr, b_ptr, y_ptr,
    E, N, K,
    stride_it, stride_ij, stride_wt, stride_wj, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_yt,
    s_ptr, stride_se, stride_sn, stride_sk, UP_SOFF, UP_SROW,
    HAS_BIAS: tl.constexpr, K_TOP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, K_SCALED: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
):
    # -- token t, BLOCK_N columns of y; its k experts one after the other, in j order ----------------
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(K_TOP):
        e = tl.load(ids_ptr + t * stride_it + j * stride_ij).to(tl.int64)
        if (e >= 0) & (e < E):
            # -- o = h[t·k + j] @ Wd[e][n-block]ᵀ (+ bd[e]), streamed over I in BLOCK_K steps -------
            h_ptrs = h_ptr + (t * K_TOP + j).to(tl.int64) * K + offs_k
            w_ptrs = w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
            o = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if FP8:  # float8 weights: expert e's scale rows
                s_rows, _ = scale_rows(s_ptr, e, offs_n, N, stride_se, stride_sn, 1, 0, 0, SBN)
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                k_left = K - k * BLOCK_K
                h = tl.load(h_ptrs, mask=offs_k < k_left, other=0.0).to(tl.float32)[None, :]
                w = tl.load(w_ptrs, mask=mask_n[:, None] & (offs_k[None, :] < k_left), other=0.0)
                part = tl.sum(w.to(tl.float32) * h, axis=1)
                if K_SCALED:
                    part = part * tl.load(s_rows + (k * BLOCK_K // SBK) * stride_sk)
                o += part
                h_ptrs += BLOCK_K
                w_ptrs += BLOCK_K * stride_wk
            if FP8 and not K_SCALED:
                o = o * tl.load(s_rows)
            if HAS_BIAS:
                o += tl.load(b_ptr + e * stride_be + offs_n * stride_bn, mask=mask_n, other=0.0).to(tl.float32)
            y += tl.load(wts_ptr + t * stride_wt + j * stride_wj).to(tl.float32) * o
    tl.store(y_ptr + t.to(tl.int64) * stride_yt + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


# ---- host side --------------------------------------------------------------------------------------


def _gate_up_layout(w_gu: Tensor, I: int, interleaved: bool) -> tuple[bool, int, int]:
    """(gated, GATE_STEP, UP_ROW): gate row n of an expert is GATE_STEP·n, up row n is UP_ROW + GATE_STEP·n."""
    rows = w_gu.shape[1]
    if rows == I:
        return False, 1, 0
    if rows != 2 * I:
        raise ValueError(f"w_gate_up has {rows} rows per expert; expected 2·I = {2 * I} (gated) or I = {I} (plain)")
    return (True, 2, 1) if interleaved else (True, 1, I)


def paired_rows(w_gu: Tensor, gate_step: int) -> bool:
    """Whether gate and up rows interleave along the weight's contiguous dimension (GPT-OSS's (E, H, 2I) seen as
    (E, 2I, H)): the kernels then read them as one contiguous tile of 2·BLOCK_N rows (``PAIRED``)."""
    return gate_step == 2 and w_gu.stride(1) == 1


def _scale_args(fe, up_row: int = 0) -> tuple:
    """The kernels' scale arguments (s_ptr, its three strides, UP_SOFF, UP_SROW) for float8 weights ``fe``
    (``fp8.Fp8Experts``), stand-ins never read for float weights (None). ``up_row``: the up half's first row."""
    if fe is None:
        return (None, 0, 0, 0, 0, 0)
    sc = fe.scale
    return (sc, *sc.stride(), fe.up_soff, 0 if fe.up_soff else up_row)


def _a8_args(xs: Tensor | None) -> tuple:
    """The grouped kernels' (xs_ptr, stride_xs): the scales of float8 activations (W8A8), or stand-ins never read."""
    return (None, 0) if xs is None else (xs, xs.stride(0))


def _scale_constexprs(fe, block_k: int, a8: bool | None = None, quant_x: bool = False) -> dict:
    """FP8, K_SCALED, SBN, SBK and BLOCK_K (a K step never straddles a scale block, the activations' 128 columns
    with ``a8``) for ``_scale_args``' weights; A8 and QUANT_X unless ``a8`` is None (the GEMV kernels have no such
    flags); ``quant_x`` as ``quant_in_gemm`` decided it."""
    a8_flag = {} if a8 is None else {"A8": a8, "QUANT_X": quant_x}
    check_a8(fe, bool(a8))
    if fe is None:
        return {"FP8": False, "K_SCALED": False, "SBN": 1, "SBK": 1, "BLOCK_K": block_k, **a8_flag}
    if a8:
        while A8_BLOCK % block_k:
            block_k //= 2
    if fe.k_scaled:
        while fe.block_k % block_k:
            block_k //= 2
    return {"FP8": True, "K_SCALED": fe.k_scaled, "SBN": fe.block_n, "SBK": fe.block_k if fe.k_scaled else 1,
            "BLOCK_K": block_k, **a8_flag}


FUSED_QUANT_MAX_PAIRS = 64  # above, quantizing in every N tile may cost more than the launch saved (dense: 64 rows)


def quant_in_gemm(fe, cfg: dict, S: int) -> bool:
    """Whether a W8A8 grouped GEMM on float8 weights ``fe`` under ``cfg`` quantizes its activations itself (QUANT_X:
    no quantize_rows launch): where its K step is one 128-column activation block, and as ``cfg["QUANT_X"]`` says,
    by default to ``FUSED_QUANT_MAX_PAIRS`` pairs (decode)."""
    return (fe is not None and cfg.get("QUANT_X", S <= FUSED_QUANT_MAX_PAIRS)
            and _scale_constexprs(fe, cfg["BLOCK_K"], True)["BLOCK_K"] == A8_BLOCK)


def _launch_opts(config: dict) -> dict:
    return {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}


def moe_gate_up(x: Tensor, routing: Routing | None, w_gu: Tensor, b_gu: Tensor | None, act: ExpertAct, I: int,
                interleaved: bool = False, config: dict | None = None, ids: Tensor | None = None,
                counts: Tensor | None = None, pdl: bool = False, scale=None, xs: Tensor | None = None,
                out_dtype: torch.dtype | None = None, quant_x: bool = False, gu: Tensor | None = None) -> Tensor:
    """h (S, I) in x's dtype, row p = A(x[p // k] @ Wgu[e]ᵀ + bgu[e]) for pair p of expert e; rows of dropped
    pairs are left unwritten. ``config``: BLOCK_N, BLOCK_K, num_warps, num_stages (BLOCK_M is the routing's).
    ``routing`` None: no routing, every pair its own block (a BLOCK_M tile with one live row), ``ids`` (T, k).
    ``counts``: an int32 buffer (``combine_counts``) that the kernel zeroes for ``moe_down_combine``, which then
    needs no memset launch; ``pdl``: the kernel lets a down kernel launched with ``pdl`` start early (Hopper).
    ``scale``: w_gu is float8 with these scales (``fp8.Fp8Experts``), dequantized tile by tile in registers; with
    ``xs`` x is float8 too (``fp8.quantize_rows``: its scales per row and 128 columns) and the fp8 tensor cores
    multiply (W8A8); h then in ``out_dtype``. ``quant_x`` (where ``quant_in_gemm``): W8A8 with x in its own dtype,
    quantized by the kernel as quantize_rows would (no ``xs``). ``gu``: a contiguous (S, 2I or I) tensor in x's
    dtype where the kernel also stores x[p // k] @ Wgu[e]ᵀ + bgu[e] (row p, Wgu's row layout), h then computed from
    those rounded values (a training forward that keeps them for the backward)."""
    T, H = x.shape
    k = routing.k if routing is not None else ids.shape[1]
    S = T * k
    E = w_gu.shape[0]
    _gate_up_layout(w_gu, I, interleaved)  # its shape check, before any early return
    cfg = config or default_config("gate_up", T, k, E, H, I, x.dtype, x.device)
    h = torch.empty((S, I), dtype=out_dtype or x.dtype, device=x.device)
    n_blocks = routing.block_expert.shape[0] if routing is not None else S
    if n_blocks == 0 or I == 0:
        if counts is not None:  # no kernel to zero them
            counts.zero_()
        return h
    _check_gu(gu, S, w_gu, x.dtype)
    if counts is not None and (counts.dtype != torch.int32 or not counts.is_contiguous()):
        raise ValueError(f"moe_gate_up: counts must be a contiguous int32 tensor, not {counts.dtype} {counts.stride()}")
    b = b_gu if b_gu is not None else w_gu  # a valid pointer, never read without HAS_BIAS
    blocks = (routing.sorted_pairs, routing.block_expert, routing.num_blocks) if routing is not None else (None,) * 3
    grid, ints, ints_ids, n_counts, constexprs = _gate_up_args(
        x, ids, k, (n_blocks, routing.block_m) if routing is not None else None, w_gu, b_gu, act, I, interleaved, cfg,
        counts.numel() if counts is not None else None, pdl, scale, xs, quant_x, gu is not None)
    launch(_moe_gate_up_kernel, grid, x, w_gu, b, h, *blocks, *ints, ids if routing is None else None, *ints_ids,
           counts, n_counts, gu, **constexprs)
    return h


def _gate_up_args(x: Tensor, ids: Tensor | None, k: int, blocks: tuple[int, int] | None, w_gu: Tensor,
                  b_gu: Tensor | None, act: ExpertAct, I: int, interleaved: bool, cfg: dict, n_counts: int | None,
                  pdl: bool, scale=None, xs: Tensor | None = None, quant_x: bool = False,
                  save_gu: bool = False) -> tuple[tuple, tuple, tuple, int | None, dict]:
    """The gate_up launch but its tensors (for h contiguous): grid, the integers before ids and after it, the
    counters' size, constexprs. ``blocks``: the routing's (blocks, BLOCK_M), None for every pair its own block;
    ``save_gu``: the pre-activations stored too (``moe_gate_up``'s ``gu``)."""
    T, H = x.shape
    S = T * k
    E = w_gu.shape[0]
    gated, step, up_row = _gate_up_layout(w_gu, I, interleaved)
    b = b_gu if b_gu is not None else w_gu
    n_blocks, block_m = blocks if blocks is not None else (S, PER_PAIR_BLOCK_M)
    grid = (n_blocks, cdiv(I, cfg["BLOCK_N"]))
    ints = (S, k, I, H, up_row, x.stride(0), x.stride(1), *w_gu.stride(), b.stride(0), b.stride(-1),
            *_scale_args(scale, up_row), *_a8_args(xs))
    ints_ids = (E, ids.stride(0), ids.stride(1)) if blocks is None else (None,) * 3
    return grid, ints, ints_ids, n_counts, dict(
        GATED=gated, HAS_BIAS=b_gu is not None, GATE_STEP=step, **act.constexprs(),
        PRECISION=dot_precision(x.dtype), BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
        **_scale_constexprs(scale, cfg["BLOCK_K"], xs is not None or quant_x, quant_x), PER_PAIR=blocks is None,
        ZERO_COUNTS=n_counts is not None,
        BLOCK_C=next_power_of_2(cdiv(n_counts, grid[0] * grid[1])) if n_counts is not None else 1,
        LAUNCH_DEPENDENTS=pdl and has_pdl(x.device), SAVE_GU=save_gu,
        PAIRED=paired_rows(w_gu, step) and scale is None, **_launch_opts(cfg))


def has_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` may use programmatic dependent launch: a Hopper or newer GPU, not the
    interpreter (gdc_wait and gdc_launch_dependents are inline PTX)."""
    return not INTERPRET and device.type == "cuda" and _capability(device.index)[0] >= 9


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def combine_counts(T: int, H: int, down_config: dict, device: torch.device) -> Tensor:
    """The (T, n-blocks) int32 counters of ``moe_down_combine`` under ``down_config``, uninitialised: for
    ``moe_gate_up(counts=...)`` to zero."""
    return torch.empty((T, cdiv(H, down_config["BLOCK_N"])), dtype=torch.int32, device=device)


PER_PAIR_BLOCK_M = 16  # the smallest tile tl.dot takes: one live row in it


def rows_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the pairs' rows (down's output before the k-sum) for activations in ``dtype``: fp32, or with
    ``config.moe_rows_lowp`` the activations' own 16-bit dtype (half the bytes both ways)."""
    return dtype if _config.moe_rows_lowp and dtype in (torch.float16, torch.bfloat16) else torch.float32


def _down(h: Tensor, routing: Routing | None, ids: Tensor | None, wts: Tensor, w_d: Tensor, b_d: Tensor | None,
          y: Tensor | None, config: dict | None, counts: Tensor | None = None, pdl: bool = False,
          scale=None, xs: Tensor | None = None, quant_x: bool = False,
          rows: torch.dtype = torch.float32) -> Tensor:
    """The down kernel's launch: out (S, H) per pair in ``rows``' dtype, and with ``y`` given the combine into it as
    well (its counters ``counts`` where the gate/up kernel zeroed them, else a memset's)."""
    S, I = h.shape
    E, H = w_d.shape[0], w_d.shape[1]
    k = routing.k if routing is not None else ids.shape[1]
    cfg = config or default_config("down", S // max(k, 1), k, E, H, I, h.dtype, h.device)
    out = torch.empty((S, H), dtype=rows, device=h.device)
    n_blocks = routing.block_expert.shape[0] if routing is not None else S
    if n_blocks == 0 or H == 0:
        return out
    h = h.contiguous()
    b = b_d if b_d is not None else w_d
    blocks = (routing.sorted_pairs, routing.block_expert, routing.num_blocks) if routing is not None else (None,) * 3
    grid, ints, ints_ids, constexprs = _down_args(
        S, k, (n_blocks, routing.block_m) if routing is not None else None, h.dtype, ids, wts, w_d, b_d, cfg,
        y is not None, pdl and has_pdl(h.device), scale, xs, quant_x)
    if y is not None:  # a counter per (token, n-block): its k_valid-th arriver sums the token's rows
        if counts is None:
            counts = torch.zeros((S // k, grid[1]), dtype=torch.int32, device=h.device)
        elif counts.shape != (S // k, grid[1]) or counts.dtype != torch.int32:
            raise ValueError(f"moe_down_combine: counts must be int32 of shape {(S // k, grid[1])} (combine_counts "
                             f"with this down config), not {counts.dtype} {tuple(counts.shape)}")
    else:
        counts = None
    launch(_moe_down_kernel, grid, h, w_d, b, wts, out, *blocks, *ints,
           ids if y is not None or routing is None else None, y, counts, *ints_ids, **constexprs)
    return out


def _down_args(S: int, k: int, blocks: tuple[int, int] | None, h_dtype: torch.dtype, ids: Tensor | None,
               wts: Tensor, w_d: Tensor, b_d: Tensor | None, cfg: dict, combine: bool,
               pdl: bool, scale=None, xs: Tensor | None = None,
               quant_x: bool = False) -> tuple[tuple, tuple, tuple, dict]:
    """The down launch but its tensors (for h, out and y contiguous): grid, the integers before ids and after the
    counters, constexprs. ``blocks`` as in ``_gate_up_args``; ``combine``: the sum into y as well; ``pdl``: launched
    by PDL (``has_pdl`` checked)."""
    E, H, I = w_d.shape
    b = b_d if b_d is not None else w_d
    n_blocks, block_m = blocks if blocks is not None else (S, PER_PAIR_BLOCK_M)
    grid = (n_blocks, cdiv(H, cfg["BLOCK_N"]))
    ints = (S, k, H, I, *w_d.stride(), b.stride(0), b.stride(-1), wts.stride(0), wts.stride(1), *_scale_args(scale),
            *_a8_args(xs))
    if combine:
        ints_ids = (E, ids.stride(0), ids.stride(1), H)
    elif blocks is None:
        ints_ids = (E, ids.stride(0), ids.stride(1), None)
    else:
        ints_ids = (None,) * 4
    return grid, ints, ints_ids, dict(
        HAS_BIAS=b_d is not None, PRECISION=dot_precision(h_dtype), BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
        **_scale_constexprs(scale, cfg["BLOCK_K"], xs is not None or quant_x, quant_x), PER_PAIR=blocks is None,
        COMBINE=combine,
        BLOCK_T=next_power_of_2(cdiv(S // max(k, 1), n_blocks)) if combine else 1,
        BLOCK_J=next_power_of_2(k) if combine else 1, **_pdl_opts(pdl), **_launch_opts(cfg))


def _pdl_opts(pdl: bool) -> dict:
    """The down kernel's gdc_wait and Triton's launch option, or nothing new (an unchanged launch) without PDL."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl else {"USE_PDL": False}


def moe_down(h: Tensor, routing: Routing, wts: Tensor, w_d: Tensor, b_d: Tensor | None,
             config: dict | None = None, scale=None, xs: Tensor | None = None, quant_x: bool = False,
             rows: torch.dtype = torch.float32) -> Tensor:
    """out (S, H) in ``rows``' dtype (fp32 unless asked), row p = (h[p] @ Wd[e]ᵀ + bd[e]) · w[p] for pair p of expert
    e (dropped pairs unwritten); ``scale``, ``xs`` (h's) and ``quant_x`` (h quantized by the kernel) as in
    ``moe_gate_up``."""
    return _down(h, routing, None, wts, w_d, b_d, None, config, scale=scale, xs=xs, quant_x=quant_x, rows=rows)


def moe_down_combine(h: Tensor, routing: Routing | None, ids: Tensor, wts: Tensor, w_d: Tensor, b_d: Tensor | None,
                     dtype: torch.dtype, config: dict | None = None, counts: Tensor | None = None,
                     pdl: bool = False, scale=None, xs: Tensor | None = None, quant_x: bool = False) -> Tensor:
    """y (T, H) in ``dtype``, as ``moe_combine(moe_down(...))`` computes it bit for bit, in one launch: each
    program stores its pairs' rows (``rows_dtype``), and the last of a token's valid pairs to arrive (a counter per
    token and n-block) sums the token's rows in j order. ``routing`` None: every pair its own block, as in
    ``moe_gate_up``.
    ``counts``: the counters as ``moe_gate_up(counts=...)`` zeroed them, under this ``config`` (else a memset
    zeroes new ones); ``pdl``: launched to overlap the tail of the kernel before it on the stream, which must be
    ``moe_gate_up(pdl=True)`` launched without PDL (Hopper): h and the counters are read after its end, the ids,
    weights and routing before it (complete, as everything before that gate/up kernel is)."""
    T, k = ids.shape
    y = torch.empty((T, w_d.shape[1]), dtype=dtype, device=h.device)
    if T > 0:
        _down(h, routing, ids, wts, w_d, b_d, y, config, counts, pdl, scale, xs, quant_x, rows_dtype(dtype))
    return y


def moe_combine(out: Tensor, ids: Tensor, E: int, dtype: torch.dtype, rows: Tensor | None = None) -> Tensor:
    """y (T, H) in ``dtype``: y[t] = Σ_j out[t·k + j] over the j with ids[t, j] in [0, E), in j order; with ``rows``
    (T·k,) out[rows[t·k + j]] instead (out in another order of the pairs)."""
    T, k = ids.shape
    H = out.shape[1]
    y = torch.empty((T, H), dtype=dtype, device=out.device)
    if T == 0 or H == 0:
        return y
    grid, ints, constexprs = _combine_args(ids, E, H)
    launch(_moe_combine_kernel, grid, out, rows, ids, y, *ints, **constexprs, HAS_ROWS=rows is not None)
    return y


def _combine_args(ids: Tensor, E: int, H: int) -> tuple[tuple, tuple, dict]:
    """The combine launch but its tensors (for y contiguous): grid, integer arguments, constexprs."""
    T, k = ids.shape
    block_n = min(1024, triton.next_power_of_2(H))
    return (T, cdiv(H, block_n)), (E, H, ids.stride(0), ids.stride(1), H), dict(K_TOP=k, BLOCK_N=block_n,
                                                                               num_warps=4)


def tma_shape_why_not(device: torch.device, dtype: torch.dtype, H: int, I: int, interleaved: bool) -> str | None:
    """Why no experts of this kind can be read through TMA descriptors (None: they can, given ``tma_why_not``'s
    layout): boxes need host descriptors in Triton, a Hopper GPU (or the interpreter), rows of H and I elements in
    multiples of 16 bytes, and gate and up rows not interleaved. The dispatcher asks this of a problem."""
    if TensorDescriptor is None:
        return "this Triton has no host tensor descriptors"
    if not INTERPRET and (device.type != "cuda" or _capability(device.index)[0] < 9):
        return "TMA needs a Hopper or newer GPU"
    if interleaved:
        return "gate and up rows interleaved (every other row is no TMA box)"
    if (H * dtype.itemsize) % 16 or (I * dtype.itemsize) % 16:
        return "rows of H and I elements are not 16-byte multiples"
    return None


def tma_why_not(x: Tensor, w_gu: Tensor, w_d: Tensor, interleaved: bool) -> str | None:
    """Why the sorted_tma path's kernels cannot read these weights through TMA descriptors (None: they can):
    ``tma_shape_why_not``, and each stacked weight contiguous from a 16-byte aligned address."""
    why = tma_shape_why_not(x.device, w_gu.dtype, w_gu.shape[-1], w_d.shape[-1], interleaved)
    if why is not None:
        return why
    for name, w in (("w_gate_up", w_gu), ("w_down", w_d)):
        if not w.is_contiguous():
            return f"{name} is not contiguous (strides {w.stride()})"
        if w.data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
    return None


def _desc(w: Tensor, cfg: dict, block_k: int | None = None):
    """The (E·rows, K) view of a stacked weight as a descriptor of (BLOCK_N, BLOCK_K) boxes (``block_k``: BLOCK_K as
    the scales cut it), kept with the weight."""
    return kept_desc(w, cfg["BLOCK_N"], block_k or cfg["BLOCK_K"])


def _tma_a8(scale, block_k: int, block_n: int, xs: Tensor | None, up_row: int | None = None) -> tuple[tuple, dict]:
    """The TMA kernels' scale integers (``_scale_args``, with UP_SOFF and UP_SROW where ``up_row`` is given: the
    gate/up kernel's; ``_a8_args``) and constexprs: W8A8 where ``scale`` and ``xs`` are given (BLOCK_K cut to lie in
    one activation and one weight scale block, ``_scale_constexprs``), else stand-ins never read."""
    scale_ints = _scale_args(scale, up_row or 0)
    ints = (*scale_ints[:4], *(scale_ints[4:] if up_row is not None else ()), *_a8_args(xs))
    if scale is None:
        return ints, {"A8": False, "K_SCALED": False, "SBN": 1, "SBK": 1, "BLOCK_K": block_k}
    if xs is None:
        raise ValueError("the sorted_tma kernels read float8 weights with float8 activations only (W8A8: xs)")
    return ints, _tma_a8_constexprs(scale, block_k, block_n, scale_ints[5] if up_row is not None else 0)


def _tma_a8_constexprs(scale, block_k: int, block_n: int, up_srow: int) -> dict:
    """The TMA kernels' W8A8 constexprs for float8 weights ``scale`` (``_tma_a8``'s; ``up_srow``: UP_SROW)."""
    c = _scale_constexprs(scale, block_k, True)
    return {"A8": True, "K_SCALED": c["K_SCALED"], "SBN": c["SBN"], "SBK": c["SBK"], "BLOCK_K": c["BLOCK_K"],
            "WS_TILE": ws_tile(scale, block_n, up_srow)}


def ws_tile(scale, block_n: int, up_srow: int) -> bool:
    """Whether every BLOCK_N tile of a TMA kernel's columns lies in one weight scale block, its up half's too (a
    K step then scales by one weight scale: ``a8_part``'s WS_TILE)."""
    return scale.k_scaled and scale.block_n % block_n == 0 and up_srow % scale.block_n == 0


def _check_gu(gu: Tensor | None, S: int, w_gu: Tensor, dtype: torch.dtype) -> None:
    if gu is not None and (gu.shape != (S, w_gu.shape[1]) or gu.dtype != dtype or not gu.is_contiguous()):
        raise ValueError(f"moe_gate_up: gu must be a contiguous {dtype} tensor of shape {(S, w_gu.shape[1])}, not "
                         f"{gu.dtype} {tuple(gu.shape)}")


def moe_gate_up_tma(x: Tensor, routing: Routing, w_gu: Tensor, b_gu: Tensor | None, act: ExpertAct, I: int,
                    config: dict, gu: Tensor | None = None, scale=None, xs: Tensor | None = None,
                    out_dtype: torch.dtype | None = None, quant_h: bool = False):
    """``moe_gate_up`` on a sorted routing with the weights read through TMA (where ``tma_why_not`` is None);
    ``gu``: as ``moe_gate_up``'s (the pre-activations kept per pair). ``scale`` and ``xs``: W8A8, as ``moe_gate_up``
    takes them (float8 boxes, x float8 gathered by pointer; h in ``out_dtype``). ``quant_h`` (W8A8, BLOCK_N 128 =
    one activation block, no ``gu``): (h8, hs) as ``quantize_rows(h)`` gives them, no h in ``out_dtype`` written."""
    T, H = x.shape
    S = T * routing.k
    gated, _, up_row = _gate_up_layout(w_gu, I, False)
    _check_gu(gu, S, w_gu, x.dtype)
    h_dtype = out_dtype or x.dtype
    if quant_h and (xs is None or config["BLOCK_N"] != A8_BLOCK or gu is not None):
        raise ValueError("moe_gate_up_tma: quant_h takes W8A8 (xs), BLOCK_N 128 and no gu")
    h = torch.empty((S, I), dtype=FP8 if quant_h else h_dtype, device=x.device)
    hs = torch.empty((S, cdiv(I, A8_BLOCK)), dtype=torch.float32, device=x.device) if quant_h else None
    n_blocks = routing.block_expert.shape[0]
    if n_blocks == 0 or I == 0:
        return (h, hs) if quant_h else h
    b = b_gu if b_gu is not None else w_gu  # a valid pointer, never read without HAS_BIAS
    grid = (n_blocks, cdiv(I, config["BLOCK_N"]))
    ints_a8, const_a8 = _tma_a8(scale, config["BLOCK_K"], config["BLOCK_N"], xs, up_row)
    launch(_moe_gate_up_tma_kernel, grid,
           x, _desc(w_gu, config, const_a8["BLOCK_K"]), b, h, routing.sorted_pairs, routing.block_expert,
           routing.num_blocks, S, routing.k, I, H, up_row, w_gu.shape[1], x.stride(0), x.stride(1), b.stride(0),
           b.stride(-1), gu if gu is not None else h, *ints_a8, hs if quant_h else h, hs.stride(0) if quant_h else 0,
           GATED=gated, HAS_BIAS=b_gu is not None, **act.constexprs(), PRECISION=dot_precision(x.dtype),
           BLOCK_M=routing.block_m, BLOCK_N=config["BLOCK_N"], SAVE_GU=gu is not None, **const_a8,
           QUANT_H=quant_h, H_ROUND=_TL_DTYPES[h_dtype], **_launch_opts(config))
    return (h, hs) if quant_h else h


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def fused_h_quant(up_config: dict) -> bool:
    """Whether the W8A8 TMA gate/up launch quantizes h itself (``moe_gate_up_tma``'s ``quant_h``): where
    ``config.fp8_fused_h`` is on and a tile's columns are one 128-column activation block; never under the
    interpreter (its fp32 -> float8 cast misrounds where rounding carries: ``fp8.quantize_rows``)."""
    return _config.fp8_fused_h and not INTERPRET and up_config["BLOCK_N"] == A8_BLOCK


def moe_down_tma(h: Tensor, routing: Routing, wts: Tensor, w_d: Tensor, b_d: Tensor | None, config: dict,
                 rows: torch.dtype = torch.float32, scale=None, xs: Tensor | None = None) -> Tensor:
    """``moe_down`` with Wd read through TMA: out (S, H) per pair in ``rows``' dtype, the rows of dropped pairs
    unwritten; ``scale`` and ``xs`` (h's): W8A8, as in ``moe_gate_up_tma``."""
    S, I = h.shape
    H = w_d.shape[1]
    out = torch.empty((S, H), dtype=rows, device=h.device)
    n_blocks = routing.block_expert.shape[0]
    if n_blocks == 0 or H == 0:
        return out
    h = h.contiguous()
    b = b_d if b_d is not None else w_d
    grid = (n_blocks, cdiv(H, config["BLOCK_N"]))
    ints_a8, const_a8 = _tma_a8(scale, config["BLOCK_K"], config["BLOCK_N"], xs)
    launch(_moe_down_tma_kernel, grid,
           h, _desc(w_d, config, const_a8["BLOCK_K"]), b, wts, out, routing.sorted_pairs, routing.block_expert,
           routing.num_blocks, S, routing.k, H, I, b.stride(0), b.stride(-1), wts.stride(0), wts.stride(1), *ints_a8,
           HAS_BIAS=b_d is not None, PRECISION=dot_precision(h.dtype), BLOCK_M=routing.block_m,
           BLOCK_N=config["BLOCK_N"], **const_a8, **_launch_opts(config))
    return out


def moe_gate_up_pairs(x: Tensor, ids: Tensor, w_gu: Tensor, b_gu: Tensor | None, act: ExpertAct, I: int,
                      interleaved: bool = False, config: dict | None = None, scale=None) -> Tensor:
    """h (S, I) as ``moe_gate_up`` computes it, with no routing: one GEMV program per (pair, BLOCK_N columns)."""
    T, k = x.shape[0], ids.shape[1]
    h = torch.empty((T * k, I), dtype=x.dtype, device=x.device)
    if T * k == 0 or I == 0:
        return h
    grid, ints, constexprs = _gate_up_pairs_args(x, ids, w_gu, b_gu, act, I, interleaved, config, scale)
    launch(_moe_gate_up_pairs_kernel, grid, x, ids, w_gu, b_gu if b_gu is not None else w_gu, h, *ints, **constexprs)
    return h


def _gate_up_pairs_args(x: Tensor, ids: Tensor, w_gu: Tensor, b_gu: Tensor | None, act: ExpertAct, I: int,
                        interleaved: bool, config: dict | None, scale=None) -> tuple[tuple, tuple, dict]:
    """The gate_up_pairs launch but its tensors: grid, integer arguments, constexprs (for h contiguous)."""
    T, H = x.shape
    k = ids.shape[1]
    E = w_gu.shape[0]
    gated, step, up_row = _gate_up_layout(w_gu, I, interleaved)
    cfg = config or default_config("gate_up_pairs", T, k, E, H, I, x.dtype, x.device)
    b = b_gu if b_gu is not None else w_gu  # a valid pointer, never read without HAS_BIAS
    ints = (E, k, I, H, up_row, x.stride(0), x.stride(1), ids.stride(0), ids.stride(1), *w_gu.stride(), b.stride(0),
            b.stride(-1), *_scale_args(scale, up_row))
    return (T * k, cdiv(I, cfg["BLOCK_N"])), ints, dict(
        GATED=gated, HAS_BIAS=b_gu is not None, GATE_STEP=step, **act.constexprs(),
        BLOCK_N=cfg["BLOCK_N"], **_scale_constexprs(scale, cfg["BLOCK_K"]), **_launch_opts(cfg))


def moe_down_tokens(h: Tensor, ids: Tensor, wts: Tensor, w_d: Tensor, b_d: Tensor | None, dtype: torch.dtype,
                    config: dict | None = None, scale=None) -> Tensor:
    """y (T, H) in ``dtype``: y[t] = Σ_j w[t, j] · (h[t·k + j] @ Wd[e]ᵀ + bd[e]) over valid j, in j order, summed in
    registers (no (S, H) buffer). h may come from either gate/up kernel."""
    T = ids.shape[0]
    H = w_d.shape[1]
    y = torch.empty((T, H), dtype=dtype, device=h.device)
    if T == 0 or H == 0:
        return y
    h = h.contiguous()
    grid, ints, constexprs = _down_tokens_args(h.dtype, ids, wts, w_d, b_d, config, scale)
    launch(_moe_down_tokens_kernel, grid, h, ids, wts, w_d, b_d if b_d is not None else w_d, y, *ints, **constexprs)
    return y


def _down_tokens_args(h_dtype: torch.dtype, ids: Tensor, wts: Tensor, w_d: Tensor, b_d: Tensor | None,
                      config: dict | None, scale=None) -> tuple[tuple, tuple, dict]:
    """The down_tokens launch but its tensors: grid, integer arguments, constexprs (for h and y contiguous)."""
    T, k = ids.shape
    E, H, I = w_d.shape
    cfg = config or default_config("down_tokens", T, k, E, H, I, h_dtype, w_d.device)
    b = b_d if b_d is not None else w_d
    ints = (E, H, I, ids.stride(0), ids.stride(1), wts.stride(0), wts.stride(1), *w_d.stride(), b.stride(0),
            b.stride(-1), H, *_scale_args(scale))
    return (T, cdiv(H, cfg["BLOCK_N"])), ints, dict(
        HAS_BIAS=b_d is not None, K_TOP=k, BLOCK_N=cfg["BLOCK_N"], **_scale_constexprs(scale, cfg["BLOCK_K"]),
        **_launch_opts(cfg))


PATHS = ("sorted", "sorted_fused", "sorted_fused_nomemset", "sorted_fused_pdl", "unsorted", "unsorted_nomemset",
         "unsorted_pdl", "pairs", "sorted_tma")
# the fused paths: (counters zeroed by the gate/up kernel rather than a memset, PDL between the kernels)
_FUSED = {f"{base}{variant}": flags for base in ("sorted_fused", "unsorted")
          for variant, flags in (("", (False, False)), ("_nomemset", (True, False)), ("_pdl", (True, True)))}
_GROUPED = ("sorted", *_FUSED)  # the paths of the gate/up kernel that can keep gu


def moe_experts(x: Tensor, ids: Tensor, wts: Tensor, w_gu: Tensor, b_gu: Tensor | None, w_d: Tensor,
                b_d: Tensor | None, act: ExpertAct = ExpertAct(), interleaved: bool = False, path: str = "sorted",
                configs: dict | None = None, scales: tuple | None = None, a8: bool = False,
                gu: Tensor | None = None) -> Tensor:
    """y (T, H) in x's dtype through one of PATHS: "sorted" (routing, gate_up, down, combine: 4 launches;
    "sorted_tma" the same with the weights read through TMA where ``tma_why_not`` allows),
    "sorted_fused" (routing, gate_up, down with the combine: 3), "unsorted" (gate_up and down+combine with every
    pair its own block, no routing: 2, for one token), "pairs" (gate_up_pairs, down_tokens: 2, for few tokens).
    The fused ones also as "<path>_nomemset" (the combine's counters zeroed by gate_up: one launch fewer) and
    "<path>_pdl" (that, and down launched with programmatic dependent launch, overlapping gate_up's tail).
    ``configs``: a config per kind of CONFIGS, else default_config's. ``scales``: (gate/up's, down's)
    ``fp8.Fp8Experts`` of float8 weights w_gu and w_d (W8A16: tiles dequantized in registers; sorted_tma then runs
    sorted); ``a8``: with them, x and h quantized per row and 128 columns and multiplied on the fp8 tensor cores
    (W8A8, the grouped paths; "pairs" stays W8A16). ``gu``: the gate/up kernel also stores the pre-activations there
    (``moe_gate_up``'s ``gu``, the training forward of backward "save"): the grouped paths and sorted_tma, on float8
    weights W8A16 only (sorted_tma then runs sorted)."""
    T, k = ids.shape
    E, H, I = w_d.shape
    s_gu, s_d = scales if scales is not None else (None, None)
    if gu is not None and (path == "pairs" or (scales is not None and a8)):
        raise ValueError(f"moe_experts: the {'W8A8' if a8 else path} path keeps no pre-activations (gu)")
    if scales is not None and path == "sorted_tma" and not a8:
        path = "sorted"
    if scales is not None and a8 and path != "pairs":
        return _experts_a8(x, ids, wts, w_gu, w_d, act, interleaved, path, configs, s_gu, s_d)

    def cfg(kind: str) -> dict:
        return (configs or {}).get(kind) or default_config(kind, T, k, E, H, I, x.dtype, x.device)

    if path == "pairs":
        h = moe_gate_up_pairs(x, ids, w_gu, b_gu, act, I, interleaved, cfg("gate_up_pairs"), s_gu)
        return moe_down_tokens(h, ids, wts, w_d, b_d, x.dtype, cfg("down_tokens"), s_d)
    if path not in PATHS:
        raise ValueError(f"moe_experts: path must be one of {PATHS}, not {path!r}")
    if path == "sorted_tma":
        if tma_why_not(x, w_gu, w_d, interleaved) is not None:
            path = "sorted"  # the same kernels with pointer loads
        else:
            up = cfg("gate_up_tma")
            routing = moe_align(ids, E, up["BLOCK_M"])
            h = moe_gate_up_tma(x, routing, w_gu, b_gu, act, I, up, gu)
            return moe_combine(moe_down_tma(h, routing, wts, w_d, b_d, cfg("down_tma"), rows_dtype(x.dtype)), ids, E,
                               x.dtype)
    no_memset, pdl = _FUSED.get(path, (False, False))
    down = cfg("down")
    counts = combine_counts(T, H, down, x.device) if no_memset else None
    if path.startswith("unsorted"):
        h = moe_gate_up(x, None, w_gu, b_gu, act, I, interleaved, cfg("gate_up"), ids, counts, pdl, s_gu, gu=gu)
        return moe_down_combine(h, None, ids, wts, w_d, b_d, x.dtype, down, counts, pdl, s_d)
    up = cfg("gate_up")
    routing = moe_align(ids, E, up["BLOCK_M"])
    h = moe_gate_up(x, routing, w_gu, b_gu, act, I, interleaved, up, counts=counts, pdl=pdl, scale=s_gu, gu=gu)
    if path in _FUSED:
        return moe_down_combine(h, routing, ids, wts, w_d, b_d, x.dtype, down, counts, pdl, s_d)
    return moe_combine(moe_down(h, routing, wts, w_d, b_d, down, s_d, rows=rows_dtype(x.dtype)), ids, E, x.dtype)


def _experts_a8(x: Tensor, ids: Tensor, wts: Tensor, w_gu: Tensor, w_d: Tensor, act: ExpertAct, interleaved: bool,
                path: str, configs: dict | None, s_gu, s_d) -> Tensor:
    """``moe_experts`` on float8 weights with float8 activations (W8A8): x quantized before gate/up, h before down
    (``fp8.quantize_rows``: one scale per row and 128 columns, transformers' dynamic scheme), or by the GEMM itself
    where ``quant_in_gemm``."""
    T, k = ids.shape
    E, H, I = w_d.shape

    def cfg(kind: str) -> dict:
        return _fp8_config(kind, configs, True, T, k, E, H, I, x)

    if path == "sorted_tma":
        if tma_why_not(x, w_gu, w_d, interleaved) is None:
            up = cfg("gate_up_tma")
            routing = moe_align(ids, E, up["BLOCK_M"])
            xq, xs = quantize_rows(x)
            if fused_h_quant(up):
                hq, hs = moe_gate_up_tma(xq, routing, w_gu, None, act, I, up, scale=s_gu, xs=xs, out_dtype=x.dtype,
                                         quant_h=True)
            else:
                hq, hs = quantize_rows(moe_gate_up_tma(xq, routing, w_gu, None, act, I, up, scale=s_gu, xs=xs,
                                                       out_dtype=x.dtype))
            out = moe_down_tma(hq, routing, wts, w_d, None, cfg("down_tma"), rows_dtype(x.dtype), s_d, hs)
            return moe_combine(out, ids, E, x.dtype)
        path = "sorted"  # the same GEMMs with pointer loads
    no_memset, pdl = _FUSED.get(path, (False, False))
    up, down = cfg("gate_up"), cfg("down")
    qx, qh = quant_in_gemm(s_gu, up, T * k), quant_in_gemm(s_d, down, T * k)
    counts = combine_counts(T, H, down, x.device) if no_memset else None
    routing = None if path.startswith("unsorted") else moe_align(ids, E, up["BLOCK_M"])
    xq, xs = (x, None) if qx else quantize_rows(x)
    h = moe_gate_up(xq, routing, w_gu, None, act, I, interleaved, up, ids, counts, pdl, s_gu, xs, x.dtype, qx)
    hq, hs = (h, None) if qh else quantize_rows(h)
    if path in _FUSED:
        return moe_down_combine(hq, routing, ids, wts, w_d, None, x.dtype, down, counts, pdl, s_d, hs, qh)
    return moe_combine(moe_down(hq, routing, wts, w_d, None, down, s_d, hs, qh, rows_dtype(x.dtype)), ids, E,
                       x.dtype)


def _fp8_config(kind: str, configs: dict | None, a8: bool, T: int, k: int, E: int, H: int, I: int,
                x: Tensor) -> dict:
    """The grouped GEMMs' config on float8 weights: the one given, else W8A8's own: the TMA kernels' by rows per
    expert at any size (``moe_tuning.fp8_tma_config``), the pointer kernels' from 64 rows per expert
    (``moe_tuning.FP8_W8A8``), else the bf16 table's."""
    given = (configs or {}).get(kind)
    if given:
        return given
    if a8 and not INTERPRET and kind.endswith("_tma"):
        return moe_tuning.fp8_tma_config(kind, T * k / max(1, min(E, T * k)))
    if a8 and not INTERPRET and rows_bucket(T, k, E) >= 64:
        return dict(moe_tuning.FP8_W8A8[kind])
    return default_config(kind, T, k, E, H, I, x.dtype, x.device)


def experts_plan(x: Tensor, ids: Tensor, wts: Tensor, w_gu: Tensor, b_gu: Tensor | None, w_d: Tensor,
                 b_d: Tensor | None, act: ExpertAct = ExpertAct(), interleaved: bool = False, path: str = "sorted",
                 configs: dict | None = None, scales: tuple | None = None, a8: bool = False, save_gu: bool = False):
    """``moe_experts`` as a function of the seven tensors, for calls whose tensors have these ones' shapes, strides,
    dtypes and devices: each path with its launches' grids, integers and constexprs worked out here, once (a
    decode step's host time is the launches' argument building); empty problems call ``moe_experts``. With
    ``scales`` (float8 weights, as ``moe_experts`` takes them) a function of the seven tensors and the call's
    scales, for scales of these ones' views. ``save_gu``: a function returning (y, gu), ``moe_experts``' gu kept by
    the gate/up kernel (the grouped paths on float weights, non-empty problems)."""
    T, k = ids.shape
    E, H, I = w_d.shape
    if save_gu and (scales is not None or path not in (*_GROUPED, "sorted_tma") or T * k == 0 or I == 0 or H == 0
                    or E == 0):
        raise ValueError(f"experts_plan: save_gu plans the grouped paths ({', '.join(_GROUPED)}, sorted_tma) of float "
                         f"weights for non-empty problems, not {path!r}")
    if scales is not None:
        return _fp8_plan(x, ids, wts, w_gu, w_d, act, interleaved, path, configs, scales, a8)
    if path == "sorted_tma" and tma_why_not(x, w_gu, w_d, interleaved) is not None:
        path = "sorted"  # the same kernels with pointer loads
    if path not in PATHS or T * k == 0 or I == 0 or H == 0 or E == 0:
        return lambda x, ids, wts, w_gu, b_gu, w_d, b_d: moe_experts(x, ids, wts, w_gu, b_gu, w_d, b_d, act,
                                                                     interleaved, path, configs)
    if path == "sorted_tma":
        return _tma_plan(x, ids, w_gu, w_d, act, configs or {}, save_gu)
    if path != "pairs":
        return _grouped_plan(x, ids, wts, w_gu, b_gu, w_d, b_d, act, interleaved, path, configs or {}, save_gu)
    cfgs = configs or {}
    dtype, device = x.dtype, x.device
    grid_gu, ints_gu, const_gu = _gate_up_pairs_args(x, ids, w_gu, b_gu, act, I, interleaved,
                                                     cfgs.get("gate_up_pairs"))
    grid_d, ints_d, const_d = _down_tokens_args(dtype, ids, wts, w_d, b_d, cfgs.get("down_tokens"))
    gu, down = Prepared(_moe_gate_up_pairs_kernel, grid_gu, **const_gu), Prepared(_moe_down_tokens_kernel, grid_d,
                                                                                   **const_d)

    def pairs(x, ids, wts, w_gu, b_gu, w_d, b_d):
        h = torch.empty((T * k, I), dtype=dtype, device=device)
        gu(x, ids, w_gu, w_gu if b_gu is None else b_gu, h, *ints_gu)
        y = torch.empty((T, H), dtype=dtype, device=device)
        down(h, ids, wts, w_d, w_d if b_d is None else b_d, y, *ints_d)
        return y
    return pairs


def _fp8_plan(x: Tensor, ids: Tensor, wts: Tensor, w_gu: Tensor, w_d: Tensor, act: ExpertAct, interleaved: bool,
              path: str, configs: dict | None, scales: tuple, a8: bool):
    """``experts_plan`` on float8 weights: the grouped paths' and the pairs GEMVs' launches worked out once (the
    scales, the calls' own, in the slot ``_scale_args`` gives them); sorted_tma (sorted on float8 weights) and empty
    problems through ``moe_experts``."""
    T, k = ids.shape
    E, H, I = w_d.shape
    if path == "sorted_tma" and a8 and T * k and I and H and E and tma_why_not(x, w_gu, w_d, interleaved) is None:
        return _fp8_tma_plan(x, ids, w_gu, w_d, act, configs, scales)
    if path in _GROUPED and T * k and I and H and E:
        return _fp8_grouped_plan(x, ids, wts, w_gu, w_d, act, interleaved, path, configs, scales, a8)
    if path != "pairs" or T * k == 0 or I == 0 or H == 0 or E == 0:
        return lambda x, ids, wts, w_gu, b_gu, w_d, b_d, scales: moe_experts(
            x, ids, wts, w_gu, b_gu, w_d, b_d, act, interleaved, path, configs, scales, a8)
    cfgs = configs or {}
    dtype, device = x.dtype, x.device
    grid_gu, ints_gu, const_gu = _gate_up_pairs_args(x, ids, w_gu, None, act, I, interleaved,
                                                     cfgs.get("gate_up_pairs"), scales[0])
    grid_d, ints_d, const_d = _down_tokens_args(dtype, ids, wts, w_d, None, cfgs.get("down_tokens"), scales[1])
    head_gu, tail_gu, head_d, tail_d = ints_gu[:-6], ints_gu[-5:], ints_d[:-6], ints_d[-5:]  # around the scales
    gu, down = Prepared(_moe_gate_up_pairs_kernel, grid_gu, **const_gu), Prepared(_moe_down_tokens_kernel, grid_d,
                                                                                   **const_d)

    def pairs(x, ids, wts, w_gu, b_gu, w_d, b_d, scales):
        h = torch.empty((T * k, I), dtype=dtype, device=device)
        gu(x, ids, w_gu, w_gu, h, *head_gu, scales[0].scale, *tail_gu)
        y = torch.empty((T, H), dtype=dtype, device=device)
        down(h, ids, wts, w_d, w_d, y, *head_d, scales[1].scale, *tail_d)
        return y
    return pairs


def _fp8_grouped_plan(x: Tensor, ids: Tensor, wts: Tensor, w_gu: Tensor, w_d: Tensor, act: ExpertAct,
                      interleaved: bool, path: str, configs: dict | None, scales: tuple, a8: bool):
    """``experts_plan`` for the sorted, sorted_fused and unsorted paths on float8 weights: the launches' grids,
    integers and constexprs worked out once; a call passes its routing (none unsorted), its activations'
    quantization (``a8``: launches of their own, or in the GEMMs where ``quant_in_gemm``) and its own scales (views
    like these ones') into the slots kept for them."""
    T, k = ids.shape
    E, H, I = w_d.shape
    S, dtype, device = T * k, x.dtype, x.device
    up, down = (_fp8_config(kind, configs, a8, T, k, E, H, I, x) for kind in ("gate_up", "down"))
    qx, qh = (a8 and quant_in_gemm(fe, cfg, S) for fe, cfg in ((scales[0], up), (scales[1], down)))
    no_memset, pdl = _FUSED.get(path, (False, False))
    unsorted, combine = path.startswith("unsorted"), path in _FUSED
    blocks = None if unsorted else (max_blocks(S, E, up["BLOCK_M"]), up["BLOCK_M"])
    align = None if unsorted else align_plan(ids, E, up["BLOCK_M"])
    counts_shape = (T, cdiv(H, down["BLOCK_N"]))
    # stand-ins with the strides and dtypes of the call's operands (quantize_rows' are contiguous)
    xq = torch.empty((T, H), dtype=FP8, device=device) if a8 and not qx else x
    hq = torch.empty((S, I), dtype=FP8 if a8 and not qh else dtype, device=device)
    xs, hs = (torch.empty((n, cdiv(w, A8_BLOCK)), dtype=torch.float32, device=device) if a8 and not q else None
              for n, w, q in ((T, H, qx), (S, I, qh)))
    grid_gu, ints_gu, ids_gu, n_counts, const_gu = _gate_up_args(
        xq, ids, k, blocks, w_gu, None, act, I, interleaved, up, math.prod(counts_shape) if no_memset else None, pdl,
        scales[0], xs, qx)
    grid_d, ints_d, ids_d, const_d = _down_args(S, k, blocks, hq.dtype, ids, wts, w_d, None, down, combine,
                                                pdl and has_pdl(device), scales[1], hs, qh)
    grid_c, ints_c, const_c = _combine_args(ids, E, H)
    gu, dn, comb = (Prepared(_moe_gate_up_kernel, grid_gu, **const_gu), Prepared(_moe_down_kernel, grid_d, **const_d),
                    Prepared(_moe_combine_kernel, grid_c, **const_c, HAS_ROWS=False))
    # the slots of the call's own tensors among the integers: each weight's scales, the activations' scales
    at_gu, at_d = (next(i for i, a in enumerate(ints) if a is fe.scale)
                   for ints, fe in ((ints_gu, scales[0]), (ints_d, scales[1])))
    head_gu, mid_gu = ints_gu[:at_gu], ints_gu[at_gu + 1:-2]
    head_d, mid_d = ints_d[:at_d], ints_d[at_d + 1:-2]
    xs_stride, hs_stride = ints_gu[-1], ints_d[-1]

    quant_x = _quantize_plan(T, H) if a8 and not qx else None
    quant_h = _quantize_plan(S, I) if a8 and not qh else None
    rows, i32 = rows_dtype(dtype), torch.int32

    def grouped_fp8(x, ids, wts, w_gu, b_gu, w_d, b_d, scales):
        routing = (None,) * 3 if unsorted else align(ids)[:3]
        counts = torch.empty(counts_shape, dtype=i32, device=device) if no_memset else None
        xq, xs = quant_x(x) if quant_x is not None else (x, None)
        h = torch.empty((S, I), dtype=dtype, device=device)
        gu(xq, w_gu, w_gu, h, *routing, *head_gu, scales[0].scale, *mid_gu, xs, xs_stride,
           ids if unsorted else None, *ids_gu, counts, n_counts, None)
        hq, hs = quant_h(h) if quant_h is not None else (h, None)
        out = torch.empty((S, H), dtype=rows, device=device)
        y = torch.empty((T, H), dtype=dtype, device=device)
        if combine:
            if counts is None:
                counts = torch.zeros(counts_shape, dtype=i32, device=device)
            dn(hq, w_d, w_d, wts, out, *routing, *head_d, scales[1].scale, *mid_d, hs, hs_stride, ids, y, counts,
               *ids_d)
        else:
            dn(hq, w_d, w_d, wts, out, *routing, *head_d, scales[1].scale, *mid_d, hs, hs_stride, None, None, None,
               *ids_d)
            comb(out, None, ids, y, *ints_c)
        return y
    return grouped_fp8


def _fp8_tma_plan(x: Tensor, ids: Tensor, w_gu: Tensor, w_d: Tensor, act: ExpertAct, configs: dict | None,
                  scales: tuple):
    """``experts_plan`` for sorted_tma on float8 weights, W8A8: the routing's, the quantizations' and both GEMMs'
    launches worked out once (``Prepared``: grids, integers, constexprs; per call only the tensors, the weights'
    descriptors kept with them by ``_desc``); h quantized by the gate/up launch where ``fused_h_quant``. A call whose
    weight lost its 16-byte alignment takes ``moe_experts`` (the pointer kernels)."""
    T, k = ids.shape
    E, H, I = w_d.shape
    S, n_gu = T * k, w_gu.shape[1]
    up, down = (_fp8_config(kind, configs, True, T, k, E, H, I, x) for kind in ("gate_up_tma", "down_tma"))
    align, rows = align_plan(ids, E, up["BLOCK_M"]), rows_dtype(x.dtype)
    quant_x, quant_h = _quantize_plan(T, H), _quantize_plan(S, I)
    fused, kb_h = fused_h_quant(up), cdiv(I, A8_BLOCK)
    _, _, up_row = _gate_up_layout(w_gu, I, False)
    n_blocks, dev = max_blocks(S, E, up["BLOCK_M"]), x.device
    # the scales' integers (the scale tensors themselves come with each call) and constexprs, as moe_gate_up_tma and
    # moe_down_tma work them out
    g_ints, d_ints = _scale_args(scales[0], up_row)[1:], _scale_args(scales[1])[1:4]
    g_const = _tma_a8_constexprs(scales[0], up["BLOCK_K"], up["BLOCK_N"], g_ints[4])
    d_const = _tma_a8_constexprs(scales[1], down["BLOCK_K"], down["BLOCK_N"], 0)
    kb_x = cdiv(H, A8_BLOCK)  # the row stride of x's scales (quantize_rows': contiguous)
    gate_up = Prepared(_moe_gate_up_tma_kernel, (n_blocks, cdiv(I, up["BLOCK_N"])),
                       GATED=n_gu == 2 * I, HAS_BIAS=False, **act.constexprs(), PRECISION=dot_precision(FP8),
                       BLOCK_M=up["BLOCK_M"], BLOCK_N=up["BLOCK_N"], SAVE_GU=False, **g_const, QUANT_H=fused,
                       H_ROUND=_TL_DTYPES[x.dtype], **_launch_opts(up))
    down_k = Prepared(_moe_down_tma_kernel, (n_blocks, cdiv(H, down["BLOCK_N"])), HAS_BIAS=False,
                      PRECISION=dot_precision(FP8), BLOCK_M=up["BLOCK_M"], BLOCK_N=down["BLOCK_N"], **d_const,
                      **_launch_opts(down))
    g_fixed = (S, k, I, H, up_row, n_gu, H, 1, *w_gu.stride()[::2])  # x8 contiguous; the bias strides: stand-ins

    def tma_a8(x, ids, wts, w_gu, b_gu, w_d, b_d, scales):
        if w_gu.data_ptr() % 16 or w_d.data_ptr() % 16:
            return moe_experts(x, ids, wts, w_gu, None, w_d, None, act, False, "sorted", configs, scales, True)
        routing = align(ids)
        xq, xs = quant_x(x)
        h = torch.empty((S, I), dtype=FP8 if fused else x.dtype, device=dev)
        hs = torch.empty((S, kb_h), dtype=torch.float32, device=dev) if fused else h
        gate_up(xq, _desc(w_gu, up, g_const["BLOCK_K"]), w_gu, h, *routing[:3], *g_fixed, h, scales[0].scale,
                *g_ints, xs, kb_x, hs, kb_h if fused else 0)
        hq, hs = (h, hs) if fused else quant_h(h)
        out = torch.empty((S, H), dtype=rows, device=dev)
        down_k(hq, _desc(w_d, down, d_const["BLOCK_K"]), w_d, wts, out, *routing[:3], S, k, H, I,
               *w_d.stride()[::2], *wts.stride(), scales[1].scale, *d_ints, hs, kb_h)
        return moe_combine(out, ids, E, x.dtype)
    return tma_a8


def _tma_plan(x: Tensor, ids: Tensor, w_gu: Tensor, w_d: Tensor, act: ExpertAct, cfgs: dict, save_gu: bool = False):
    """``experts_plan`` for sorted_tma: the routing's launch worked out once, each weight's descriptors kept with it
    (``_desc``), the kernels through ``launch``; a weight that lost its 16-byte alignment takes ``moe_experts``.
    ``save_gu``: (y, gu) returned, gu kept by the gate/up kernel."""
    T, k = ids.shape
    E, H, I = w_d.shape
    S, n_gu = T * k, w_gu.shape[1]
    up = cfgs.get("gate_up_tma") or default_config("gate_up_tma", T, k, E, H, I, x.dtype, x.device)
    down = cfgs.get("down_tma") or default_config("down_tma", T, k, E, H, I, x.dtype, x.device)
    align, rows = align_plan(ids, E, up["BLOCK_M"]), rows_dtype(x.dtype)

    def tma(x, ids, wts, w_gu, b_gu, w_d, b_d):
        kept = torch.empty((S, n_gu), dtype=x.dtype, device=x.device) if save_gu else None
        if w_gu.data_ptr() % 16 or w_d.data_ptr() % 16:
            y = moe_experts(x, ids, wts, w_gu, b_gu, w_d, b_d, act, False, "sorted_tma", cfgs, gu=kept)
        else:
            routing = align(ids)
            h = moe_gate_up_tma(x, routing, w_gu, b_gu, act, I, up, kept)
            y = moe_combine(moe_down_tma(h, routing, wts, w_d, b_d, down, rows), ids, E, x.dtype)
        return (y, kept) if save_gu else y
    return tma


def _grouped_plan(x: Tensor, ids: Tensor, wts: Tensor, w_gu: Tensor, b_gu: Tensor | None, w_d: Tensor,
                  b_d: Tensor | None, act: ExpertAct, interleaved: bool, path: str, cfgs: dict, save_gu: bool = False):
    """``experts_plan`` for the sorted and unsorted paths: ``moe_experts``' launches, their arguments built here;
    ``save_gu``: (y, gu) returned, gu kept by the gate/up kernel."""
    T, k = ids.shape
    E, H, I = w_d.shape
    S, dtype, device = T * k, x.dtype, x.device
    up = cfgs.get("gate_up") or default_config("gate_up", T, k, E, H, I, dtype, device)
    down = cfgs.get("down") or default_config("down", T, k, E, H, I, dtype, device)
    no_memset, pdl = _FUSED.get(path, (False, False))
    unsorted, combine = path.startswith("unsorted"), path in _FUSED
    blocks = None if unsorted else (max_blocks(S, E, up["BLOCK_M"]), up["BLOCK_M"])
    align = None if unsorted else align_plan(ids, E, up["BLOCK_M"])
    counts_shape = (T, cdiv(H, down["BLOCK_N"]))
    grid_gu, ints_gu, ids_gu, n_counts, const_gu = _gate_up_args(
        x, ids, k, blocks, w_gu, b_gu, act, I, interleaved, up, math.prod(counts_shape) if no_memset else None, pdl,
        save_gu=save_gu)
    grid_d, ints_d, ids_d, const_d = _down_args(S, k, blocks, dtype, ids, wts, w_d, b_d, down, combine,
                                                pdl and has_pdl(device))
    grid_c, ints_c, const_c = _combine_args(ids, E, H)
    gu, down, comb = (Prepared(_moe_gate_up_kernel, grid_gu, **const_gu), Prepared(_moe_down_kernel, grid_d, **const_d),
                      Prepared(_moe_combine_kernel, grid_c, **const_c, HAS_ROWS=False))
    rows, i32, n_gu = rows_dtype(dtype), torch.int32, w_gu.shape[1]

    def grouped(x, ids, wts, w_gu, b_gu, w_d, b_d):
        routing = (None,) * 3 if unsorted else align(ids)[:3]
        counts = torch.empty(counts_shape, dtype=i32, device=device) if no_memset else None
        h = torch.empty((S, I), dtype=dtype, device=device)
        kept = torch.empty((S, n_gu), dtype=dtype, device=device) if save_gu else None
        gu(x, w_gu, w_gu if b_gu is None else b_gu, h, *routing, *ints_gu, ids if unsorted else None, *ids_gu, counts,
           n_counts, kept)
        y = torch.empty((T, H), dtype=dtype, device=device)
        out = torch.empty((S, H), dtype=rows, device=device)
        if combine:
            if counts is None:
                counts = torch.zeros(counts_shape, dtype=i32, device=device)
            down(h, w_d, w_d if b_d is None else b_d, wts, out, *routing, *ints_d, ids, y, counts, *ids_d)
        else:
            down(h, w_d, w_d if b_d is None else b_d, wts, out, *routing, *ints_d, None, None, None, *ids_d)
            comb(out, None, ids, y, *ints_c)
        return (y, kept) if save_gu else y
    return grouped


def moe_reference(x: Tensor, ids: Tensor, wts: Tensor, w_gu: Tensor, b_gu: Tensor | None, w_d: Tensor,
                  b_d: Tensor | None, act: ExpertAct = ExpertAct(), interleaved: bool = False) -> Tensor:
    """y in torch ops, fp32 throughout, rounded once to x's dtype: a loop over the experts, each on the rows routed
    to it (``torch.where`` on the ids: meant for the CPU, where it costs no sync). Differentiable."""
    T, k = ids.shape
    E, H, I = w_d.shape
    gated, step, up_row = _gate_up_layout(w_gu, I, interleaved)
    xf = x.float()
    y = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, j = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        gu = xf[tok] @ w_gu[e].float().T
        if b_gu is not None:
            gu = gu + b_gu[e].float()
        if gated:
            g, u = gu[:, 0:step * I:step], gu[:, up_row:up_row + step * I:step]
            hh = act.torch_gated(g, u)
        else:
            hh = get_activation(act.name).fn(gu)
        o = hh @ w_d[e].float().T
        if b_d is not None:
            o = o + b_d[e].float()
        y = y.index_add(0, tok, o * wts[tok, j].float()[:, None])
    return y.to(x.dtype)


# ---- configs: the device's table (moe_tuning), the first candidate that fills its SMs -------------------------

CONFIGS = moe_tuning.H200  # the measured candidates (benchmarks sweep them)
_INTERPRET_CONFIG = {  # the CPU interpreter: small tiles, so that masking at the edges is exercised
    "gate_up": _cfg(16, 32, 32, 4, 1), "down": _cfg(16, 32, 32, 4, 1),
    "gate_up_tma": _cfg(16, 32, 32, 4, 1), "down_tma": _cfg(16, 32, 32, 4, 1),
    "gate_up_pairs": _cfg(1, 16, 32, 4, 1), "down_tokens": _cfg(1, 16, 32, 4, 1),
}


def rows_bucket(T: int, k: int, E: int) -> int:
    """The M bucket of the sorted path: the mean rows per touched expert, S / min(E, S), as 16, 64 or 128."""
    S = T * k
    rows = S / max(1, min(E, S))
    return 16 if rows <= 24 else 64 if rows <= 96 else 128


def _filling(candidates: list[dict], S: int, E: int, N: int, sms: int) -> dict:
    """The first candidate whose grid fills every SM once (blocks × column tiles >= ``sms``), else the one with the
    most programs: too few programs leave SMs idle while the weights stream."""
    touched = max(1, min(E, S))

    def programs(c):
        bm = c["BLOCK_M"]
        return (touched if bm <= 16 else cdiv(S, bm) + touched // 2) * cdiv(N, c["BLOCK_N"])

    return next((c for c in candidates if programs(c) >= sms), max(candidates, key=programs))


def default_config(kind: str, T: int, k: int, E: int, H: int, I: int, dtype: torch.dtype,
                   device: torch.device | None = None) -> dict:
    """The first candidate of ``device``'s table (``moe_tuning.table``; the current CUDA device where None) for this
    size's M bucket that fills its SMs, with fewer stages where fp32 tiles do not fit its shared memory; under the
    interpreter one small config. Cached: it runs on every call of the op."""
    if kind not in CONFIGS:
        raise ValueError(f"default_config: kind must be one of {tuple(CONFIGS)}, not {kind!r}")
    if INTERPRET:
        return dict(_INTERPRET_CONFIG[kind])
    if device is None or (device.type == "cuda" and device.index is None):
        device = torch.device("cuda", torch.cuda.current_device())
    return dict(_default_config(kind, T, k, E, H, I, dtype, device))


@functools.lru_cache(maxsize=4096)
def _default_config(kind: str, T: int, k: int, E: int, H: int, I: int, dtype: torch.dtype,
                    device: torch.device) -> dict:
    buckets, sms = moe_tuning.table(device)[kind], num_sms(device)
    if kind in ("gate_up_tma", "down_tma"):  # one bucket: the path is timed only where it was measured
        cfg = dict(_filling(buckets[128], T * k, E, I if kind == "gate_up_tma" else H, sms))
    elif kind in ("gate_up", "down"):
        cfg = dict(_filling(buckets[rows_bucket(T, k, E)], T * k, E, I if kind == "gate_up" else H, sms))
    else:  # a GEMV per row: the first candidate with two programs per SM, else the one with the most programs
        rows, width = (T * k, I) if kind == "gate_up_pairs" else (T, H)
        programs = [rows * cdiv(width, c["BLOCK_N"]) for c in buckets[1]]
        enough = [c for c, n in zip(buckets[1], programs) if n >= 2 * sms]
        cfg = dict(enough[0] if enough else buckets[1][programs.index(max(programs))])
    itemsize, budget = torch.empty((), dtype=dtype).element_size(), moe_tuning.smem_budget(device)
    while cfg["num_stages"] > 2 and not k_loop_fits(cfg["num_stages"], cfg["BLOCK_M"], cfg["BLOCK_K"],
                                                    cfg["BLOCK_N"], moe_tuning.n_weights(kind), itemsize, budget):
        cfg["num_stages"] -= 1
    return cfg
