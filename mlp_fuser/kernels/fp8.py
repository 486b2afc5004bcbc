"""FP8 weights: y = x @ (w · s)ᵀ with w float8_e4m3fn (N, K) and s its scales, dequantized on chip, never in HBM.

The weight formats people ship differ only in how a scale covers the weight, so a scale is taken as a 2-D view
``s[n // SCALE_BN, k // SCALE_BK]``:
- 128 × 128 blocks (Qwen3 / DeepSeek-V3 FP8 checkpoints): s (⌈N/128⌉, ⌈K/128⌉), SCALE_BN = SCALE_BK = 128;
- per channel (compressed-tensors, torchao per-row): s (N, 1), SCALE_BN = 1, SCALE_BK = K;
- per tensor: s (1, 1), read as per channel through a stride of 0.
Where a scale changes along K (blocks) it multiplies each K step's partial product; elsewhere the whole sum, once.

One kernel, two ways to multiply, both swap-AB (the weight rows take the dot's M side, so a handful of tokens
still fills Hopper's 64-row wgmma) and split-K (each program owns an output tile and a K range; the last program
of a tile, told by an atomic counter, sums the fp32 partials in split order, sets the counter back to 0 and runs
the epilogue; a plan zeroes its counters once):
- W8A16 (A8 False): each weight tile is cast to x's dtype in registers and multiplied with x as it is;
- W8A8 (A8 True): x quantized per token and 128-wide K block (transformers' dynamic scheme), both operands fp8 on
  the fp8 tensor cores, both scales per K step. To 16 tokens with 128-wide K steps the GEMM quantizes each x tile
  itself (QUANT_X: one launch at decode); elsewhere ``quantize_rows`` beforehand.
With GATED, two weights (gate and up) share each x tile and the epilogue writes act(gate) · up; with ACT alone,
act(y); the bias last before the activation.
"""

from __future__ import annotations

import math
import threading
from functools import cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..activations import get_activation
from .common import INTERPRET, Prepared, cdiv, dot_precision, kept_desc, launch, num_sms
from .gemm import grouped_tile

try:  # host tensor descriptors (Triton >= 3.4): the large-M kernel's TMA boxes
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
A8_BLOCK = 128  # the K width of one activation scale (transformers' dynamic per-token-block quantization)
A8_MIN_K = 32  # the smallest K of a float8 tl.dot on NVIDIA GPUs


def a8_why_not(block_k: int | None) -> str | None:
    """Why W8A8 kernels cannot read weights scaled in blocks ``block_k`` wide along K (None: one scale along K), or
    None: a K step lies within one weight block and one activation block, and float8 dots step K by 32 at least."""
    if block_k is not None and math.gcd(block_k, A8_BLOCK) < A8_MIN_K:
        return (f"scale blocks {block_k} wide along K: a W8A8 K step would be {math.gcd(block_k, A8_BLOCK)}, "
                f"float8 dots take {A8_MIN_K} at least")
    return None


def a8_weight_why_not(fw) -> str | None:
    """``a8_why_not`` for a float8 weight (``Fp8Weight`` or ``Fp8Experts``): its scale blocks along K."""
    return a8_why_not(fw.block_k if fw.k_scaled else None)


def check_a8(fw, a8: bool) -> None:
    """Raise where W8A8 kernels cannot read ``fw``'s scale blocks (the dispatcher's W8A8 rows pass them over)."""
    why = a8_weight_why_not(fw) if a8 and fw is not None else None
    if why is not None:
        raise ValueError(f"mlp_fuser: W8A8 kernels cannot run these FP8 weights: {why}")


class Fp8Weight(NamedTuple):
    """A float8 weight (N, K) as the kernels read it: its scales as a 2-D fp32 view and the block each covers."""

    w: Tensor
    scale: Tensor
    block_n: int
    block_k: int

    @property
    def k_scaled(self) -> bool:
        return self.block_k < self.w.shape[1]


def fp8_weight(w: Tensor, scale: Tensor, block: tuple[int, int] | list[int] | None = None) -> Fp8Weight:
    """``w`` (N, K) float8_e4m3fn with ``scale``: per block (``block`` = (block_n, block_k), scale (⌈N/bn⌉, ⌈K/bk⌉)),
    per channel (scale (N,), (N, 1) or (1, N)) or per tensor (one element); fp32, UE8M0 or bf16 scales. Raises
    ValueError naming what does not fit."""
    if w.dim() != 2 or w.dtype != FP8:
        raise ValueError(f"mlp_fuser: an FP8 weight must be 2-D float8_e4m3fn, got {tuple(w.shape)} {w.dtype}")
    N, K = w.shape
    if not scale.dtype.is_floating_point:
        raise ValueError(f"mlp_fuser: FP8 weight scales must be float32 or float8_e8m0fnu, got {scale.dtype}")
    s = scale.float() if scale.dtype != torch.float32 else scale  # UE8M0 (powers of two) are exact in fp32
    if block is not None:
        bn, bk = int(block[0]), int(block[1])
        want = (cdiv(N, bn), cdiv(K, bk)) if bn > 0 and bk > 0 else None
        if want is None or (tuple(s.shape) != want and not (want == (1, 1) and s.numel() == 1)):
            raise ValueError(f"mlp_fuser: FP8 block scales for a weight {(N, K)} in {bn} x {bk} blocks must be "
                             f"{want}, got {tuple(scale.shape)}")
        return Fp8Weight(w, s.reshape(want), bn, min(bk, K))
    if s.numel() == 1:  # as per channel, one scale repeated (stride 0): no kernel per N
        return Fp8Weight(w, s.reshape(1, 1).expand(N, 1), 1, K)
    if tuple(s.shape) in ((N,), (N, 1), (1, N)):
        return Fp8Weight(w, s.reshape(N, 1), 1, K)
    raise ValueError(f"mlp_fuser: FP8 scales {tuple(scale.shape)} fit no format of a weight {(N, K)}: per tensor "
                     f"(1 element), per channel ({N},) or per block with a block size")


class Fp8Experts(NamedTuple):
    """Stacked float8 expert weights (E, N, K) as the experts kernels read them: scales as a 3-D fp32 view
    ``scale[e, srow(n), k // block_k]``, srow(n) = n // block_n; for a gate/up weight whose halves were quantized
    apart (transformers quantizes gate_proj and up_proj each, then stacks them), up row u = I + n reads scale row
    ``up_soff + n // block_n`` (``up_soff`` 0: one grid over all rows)."""

    w: Tensor
    scale: Tensor
    block_n: int
    block_k: int
    up_soff: int = 0

    @property
    def k_scaled(self) -> bool:
        return self.block_k < self.w.shape[2]

    def srows(self) -> Tensor:
        """The scale row of each of the N weight rows (the reference's and the tests' reading of the format)."""
        N = self.w.shape[1]
        r = torch.arange(N, device=self.scale.device) // self.block_n
        if self.up_soff:
            half = N // 2
            r[half:] = self.up_soff + torch.arange(N - half, device=self.scale.device) // self.block_n
        return r


def format_as_given(f: Fp8Weight | Fp8Experts, s: Tensor) -> tuple | None:
    """``f``'s format fields (those after w and scale) where ``f`` reads the scales ``s`` as they are (the same
    dtype, shape and strides: a later call may rebuild ``f`` from them without a new view), else None."""
    v = f.scale
    return tuple(f[2:]) if v.dtype == s.dtype and v.shape == s.shape and v.stride() == s.stride() else None


def fp8_experts(w: Tensor, scale: Tensor, block: tuple[int, int] | list[int] | None = None, gated: bool = False,
                interleaved: bool = False) -> Fp8Experts:
    """``w`` (E, N, K) float8_e4m3fn with ``scale`` as transformers' ``FP8Experts`` stores it: per block (``block``
    = (block_n, block_k): scale (E, ⌈N/bn⌉, ⌈K/bk⌉); for gated concatenated gate/up, (E, 2·⌈I/bn⌉, ⌈K/bk⌉) is read
    as each half quantized apart where I is no multiple of bn, as checkpoints quantize them), per channel ((E, N) or
    (E, N, 1)), per tensor ((E,) or (E, 1, 1)), or gated, per tensor for each half ((E, 2, 1)); fp32 or UE8M0
    scales. Raises ValueError naming what does not fit."""
    if w.dim() != 3 or w.dtype != FP8:
        raise ValueError(f"mlp_fuser: FP8 expert weights must be 3-D float8_e4m3fn, got {tuple(w.shape)} {w.dtype}")
    E, N, K = w.shape
    if not scale.dtype.is_floating_point:
        raise ValueError(f"mlp_fuser: FP8 weight scales must be float32 or float8_e8m0fnu, got {scale.dtype}")
    s = scale.float() if scale.dtype != torch.float32 else scale
    halves = gated and not interleaved and N % 2 == 0
    shape = tuple(s.shape)
    if block is not None:
        bn, bk = int(block[0]), int(block[1])
        if bn <= 0 or bk <= 0:
            raise ValueError(f"mlp_fuser: FP8 block sizes must be positive, got {(bn, bk)}")
        want = (E, cdiv(N, bn), cdiv(K, bk))
        split = (E, 2 * cdiv(N // 2, bn), cdiv(K, bk))
        if halves and shape == split and (N // 2) % bn:  # checkpoints quantize gate_proj and up_proj each
            return Fp8Experts(w, s, bn, min(bk, K), cdiv(N // 2, bn))
        if shape == want or (want[1:] == (1, 1) and s.numel() == E):
            return Fp8Experts(w, s.reshape(want), bn, min(bk, K))
        raise ValueError(f"mlp_fuser: FP8 block scales for expert weights {(E, N, K)} in {bn} x {bk} blocks must be "
                         f"{want}" + (f" (or {split}, gate and up quantized apart)" if halves else "")
                         + f", got {shape}")
    if s.numel() == E and (s.dim() == 1 or shape == (E, 1, 1)):
        return Fp8Experts(w, s.reshape(E, 1, 1).expand(E, N, 1), 1, K)
    if shape in ((E, N), (E, N, 1)):
        return Fp8Experts(w, s.reshape(E, N, 1), 1, K)
    if halves and shape == (E, 2, 1):
        return Fp8Experts(w, s, N // 2, K)
    raise ValueError(f"mlp_fuser: FP8 scales {shape} fit no format of expert weights {(E, N, K)}: per tensor ({E},), "
                     f"per channel ({E}, {N})" + (f", per half ({E}, 2, 1)" if halves else "")
                     + " or per block with a block size")


def dequantize_experts(fe: Fp8Experts, dtype: torch.dtype = torch.float32) -> Tensor:
    """The expert weights the scales describe, w · s, in ``dtype`` (the reference; never on the fused path)."""
    K = fe.w.shape[2]
    s = fe.scale[:, fe.srows()].repeat_interleave(fe.block_k, 2)[:, :, :K]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (fe.w.to(acc) * s.to(acc)).to(dtype)


def dequantize(fw: Fp8Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight the scales describe, w · s, in ``dtype`` (the reference; never on the fused path)."""
    N, K = fw.w.shape
    s = fw.scale.repeat_interleave(fw.block_n, 0)[:N].repeat_interleave(fw.block_k, 1)[:, :K]
    return (fw.w.to(torch.float32) * s.to(torch.float32)).to(dtype)


# ---- the activations' quantization (W8A8) ------------------------------------------------------------------------


@triton.jit
def quantize_tile(x):
    """Each row of a (rows, 128) fp32 tile as transformers quantizes activations: its scale amax / 448 and x / scale
    clamped to ±448 (amax / scale may round a hair past it), still fp32 for the caller's cast. Every quantization of
    x or h calls this, so their bits agree."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    return tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0), scale


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_xm, stride_xk, stride_sm, stride_sk,
                          BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK_M rows by one 128-wide K block per program: each row's scale = amax / 448, q = x / scale in fp8. Rows
    M to M_OUT (padding, cuBLAS' multiple of 4) are quantized zeros; s at strides (stride_sm, stride_sk)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    offs = kb * BLOCK + tl.arange(0, BLOCK)
    mask = (offs_m[:, None] < M) & (offs[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs[None, :] * stride_xk, mask=mask, other=0.0)
    q, scale = quantize_tile(x.to(tl.float32))
    out = (offs_m[:, None] < M_OUT) & (offs[None, :] < K)
    tl.store(q_ptr + offs_m[:, None] * K + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=out)
    tl.store(s_ptr + offs_m * stride_sm + kb * stride_sk, scale, mask=offs_m < M_OUT)


@triton.jit
def _act_quant_kernel(g_ptr, u_ptr, q_ptr, s_ptr, M, K, stride_sm, stride_sk, ACT: tl.constexpr, HAS_U: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """h = act(g) · u rounded as aten rounds it (act's result, then the product, in g's dtype), then quantized as
    ``_quantize_rows_kernel`` quantizes x: the cuBLAS MLP's glue in one pass, no bf16 h in HBM. g, u contiguous."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    offs = kb * BLOCK + tl.arange(0, BLOCK)
    mask = (offs_m[:, None] < M) & (offs[None, :] < K)
    g = tl.load(g_ptr + offs_m[:, None] * K + offs[None, :], mask=mask, other=0.0)
    h = ACT(g.to(tl.float32)).to(g.dtype).to(tl.float32)
    if HAS_U:
        u = tl.load(u_ptr + offs_m[:, None] * K + offs[None, :], mask=mask, other=0.0)
        h = (h * u.to(tl.float32)).to(g.dtype).to(tl.float32)
    q, scale = quantize_tile(h)
    tl.store(q_ptr + offs_m[:, None] * K + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + offs_m * stride_sm + kb * stride_sk, scale, mask=offs_m < M)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) as float8_e4m3fn (M, K) and fp32 scales (M, ⌈K/128⌉): one scale per token and 128-wide K block."""
    if INTERPRET:  # the interpreter's fp32 -> float8 cast misrounds where rounding carries (7.9 -> 4): aten's
        return quantize_rows_reference(x)
    M, K = x.shape
    kb = cdiv(K, A8_BLOCK)
    q = torch.empty((M, K), device=x.device, dtype=FP8)
    s = torch.empty((M, kb), device=x.device, dtype=torch.float32)
    if M:
        bm = 16 if M >= 16 else triton.next_power_of_2(M)
        launch(_quantize_rows_kernel, (cdiv(M, bm), kb), x, q, s, M, M, K, x.stride(0), x.stride(1), kb, 1,
               BLOCK_M=bm, BLOCK=A8_BLOCK, num_warps=4)
    return q, s


def quantize_rows_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """``quantize_rows`` in aten (the semantics transformers' FP8 kernel gives the activations)."""
    M, K = x.shape
    pad = cdiv(K, A8_BLOCK) * A8_BLOCK - K
    xb = torch.nn.functional.pad(x.float(), (0, pad)).view(M, -1, A8_BLOCK)
    s = xb.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    q = (xb / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(M, -1)[:, :K].contiguous()  # as the kernel's
    return q, s


def quantize_blocks(w: Tensor, block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """w (..., N, K) as float8_e4m3fn with one fp32 scale per block, amax / 448 (how FP8 checkpoints are made:
    ``dequantize`` inverts it up to e4m3's rounding); scales (..., ⌈N/block_n⌉, ⌈K/block_k⌉), on w's device."""
    *lead, N, K = w.shape
    bn, bk = block
    wp = torch.nn.functional.pad(w.float(), (0, (-K) % bk, 0, (-N) % bn))
    b = wp.view(*lead, wp.shape[-2] // bn, bn, wp.shape[-1] // bk, bk)
    s = b.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX
    q = (b / s[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view_as(wp)[..., :N, :K]
    return q.clone(memory_format=torch.contiguous_format), s  # a storage of its own size, not the padded one's


# ---- the GEMM -------------------------------------------------------------------------------------------------


@triton.jit
def _x_step(x_ptrs, kmask, mask_m, QUANT_X: tl.constexpr):
    """This K step's x tile (BLOCK_M, BLOCK_K) as the dots take it and, with QUANT_X, each row's scale (BLOCK_M,):
    the step is one 128-wide activation block, quantized by ``quantize_tile`` as ``_quantize_rows_kernel`` does (the
    same bits)."""
    x = tl.load(x_ptrs, mask=mask_m[:, None] & kmask[None, :], other=0.0)
    xs = 0.0
    if QUANT_X:
        x, xs = quantize_tile(x.to(tl.float32))
        x = x.to(tl.float8e4nv)
    return x, xs


@triton.jit
def _scaled_dot(w, x, s_ptrs, xs, k, mask_m, acc, K_SCALED: tl.constexpr, A8: tl.constexpr, QUANT_X: tl.constexpr,
                PRECISION: tl.constexpr, F16: tl.constexpr):
    """acc += (w tile · its scales) @ x tileᵀ for one K step: accᵀ's (BLOCK_N, BLOCK_M) tile in fp32.
    ``s_ptrs``: the weight rows' scales of this step's K block; ``xs``: with A8, x's rows' scales of it (QUANT_X) or
    where quantize_rows wrote x's rows' scales."""
    if not A8:
        if F16:  # float8 -> float16 is one conversion per pair on sm89+, -> bfloat16 two
            w = w.to(tl.float16)
            x = x.to(tl.float16)
        else:
            w = w.to(x.dtype)
    if K_SCALED or A8:
        part = tl.dot(w, tl.trans(x), input_precision=PRECISION)
        if K_SCALED:
            part = part * tl.load(s_ptrs)[:, None]
        if QUANT_X:
            part = part * xs[None, :]
        elif A8:
            part = part * tl.load(xs + k // 128, mask=mask_m, other=0.0)[None, :]
        acc += part
    else:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _fp8_linear_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, wu_ptr, wus_ptr, b_ptr, y_ptr, partials_ptr, counters_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_ym, stride_yn,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, K_SCALED: tl.constexpr, A8: tl.constexpr, PRECISION: tl.constexpr,
    F16: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, QUANT_X: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # -- which output tile (grouped along M for L2 reuse of the weight panels) and which K range --------------
    tile = tl.program_id(0)
    split = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x and y
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of w = columns of y
    mask_m = offs_m < M
    w_rows = tl.minimum(offs_n, N - 1)  # rows past N repeat the last one: no mask along N (never stored)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)

    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + (k_lo + offs_k)[None, :] * stride_wk
    wu_ptrs = wu_ptr + w_rows[:, None] * stride_wn + (k_lo + offs_k)[None, :] * stride_wk
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk
    s_ptrs = ws_ptr + (w_rows // SCALE_BN) * stride_sn  # + (k // SCALE_BK) * stride_sk per step
    su_ptrs = wus_ptr + (w_rows // SCALE_BN) * stride_sn
    xs_ptrs = xs_ptr + offs_m * tl.cdiv(K, 128)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        kmask = (k + offs_k) < k_hi
        w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)  # before x: the loads' order of the kernel before QUANT_X
        x, xs = _x_step(x_ptrs, kmask, mask_m, QUANT_X)
        if not QUANT_X:  # x quantized by quantize_rows beforehand, or W8A16 (xs unread)
            xs = xs_ptrs
        acc = _scaled_dot(w, x, s_ptrs + (k // SCALE_BK) * stride_sk, xs, k, mask_m, acc, K_SCALED, A8, QUANT_X,
                          PRECISION, F16)
        if GATED:
            wu = tl.load(wu_ptrs, mask=kmask[None, :], other=0.0)
            acc_u = _scaled_dot(wu, x, su_ptrs + (k // SCALE_BK) * stride_sk, xs, k, mask_m, acc_u, K_SCALED, A8,
                                QUANT_X, PRECISION, F16)
        w_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk

    mask_y = (offs_n[:, None] < N) & mask_m[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None] * stride_yn
    if SPLIT_K > 1:
        # partials laid out [split, (gate, up), M, N], fp32; the last program of the tile sums them in split order
        p_ptrs = partials_ptr + offs_m[None, :] * N + offs_n[:, None]
        stride_split = (2 if GATED else 1) * M * N
        tl.store(p_ptrs + split * stride_split, acc, mask=mask_y)
        if GATED:
            tl.store(p_ptrs + split * stride_split + M * N, acc_u, mask=mask_y)
        tl.debug_barrier()  # every thread's partial is issued before the counter moves
        done = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            # every program of the tile has counted: back to 0 for the next launch (a plan's counters are zeroed once)
            tl.store(counters_ptr + tile, 0)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(p_ptrs + s * stride_split, mask=mask_y, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_u += tl.load(p_ptrs + s * stride_split + M * N, mask=mask_y, other=0.0, cache_modifier=".cg")
            _epilogue(acc, acc_u, ws_ptr, wus_ptr, s_ptrs, su_ptrs, b_ptr, offs_n, y_ptrs, mask_y, N,
                      K_SCALED, GATED, ACT, HAS_ACT, HAS_BIAS)
    else:
        _epilogue(acc, acc_u, ws_ptr, wus_ptr, s_ptrs, su_ptrs, b_ptr, offs_n, y_ptrs, mask_y, N,
                  K_SCALED, GATED, ACT, HAS_ACT, HAS_BIAS)


@triton.jit
def _epilogue(acc, acc_u, ws_ptr, wus_ptr, s_ptrs, su_ptrs, b_ptr, offs_n, y_ptrs, mask_y, N,
              K_SCALED: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_ACT: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """The scales a whole sum shares (per channel or tensor), the bias, act (· up), cast and store."""
    if not K_SCALED:
        acc = acc * tl.load(s_ptrs)[:, None]
        if GATED:
            acc_u = acc_u * tl.load(su_ptrs)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    if HAS_ACT:
        acc = ACT(acc)
    if GATED:
        acc = acc * acc_u
    tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask_y)


@triton.jit
def _fp8_gemm_tma_kernel(
    x_desc, xs_ptr, w_desc, ws_ptr, wu_desc, wus_ptr, b_ptr, y_ptr,
    M, N, K, stride_sn, stride_sk, stride_ym, stride_yn,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, K_SCALED: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    HAS_ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """W8A8 at prefill sizes: y tile (BLOCK_M tokens, BLOCK_N columns) = x8 @ w8ᵀ, both operands fp8 boxes read by
    TMA (zero past M, N, K: no pointer tensors held in registers), each K step's product scaled by x's per-token
    scale and, for block scales, the weight rows' scale of that K block."""
    # -- which output tile (grouped along M for L2 reuse of the weight panels) ---------------------------------
    tile = tl.program_id(0)
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    s_ptrs = ws_ptr + (tl.minimum(offs_n, N - 1) // SCALE_BN) * stride_sn
    su_ptrs = wus_ptr + (tl.minimum(offs_n, N - 1) // SCALE_BN) * stride_sn
    xs_ptrs = xs_ptr + offs_m * tl.cdiv(K, 128)

    # -- the K loop: fp8 boxes in, fp32 products scaled per K step ---------------------------------------------
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([off_m, k])
        xs = tl.load(xs_ptrs + k // 128, mask=mask_m, other=0.0)[:, None]
        part = tl.dot(x, w_desc.load([off_n, k]).T)
        if K_SCALED:
            acc += part * (xs * tl.load(s_ptrs + (k // SCALE_BK) * stride_sk)[None, :])
        else:
            acc += part * xs
        if GATED:
            part_u = tl.dot(x, wu_desc.load([off_n, k]).T)
            if K_SCALED:
                acc_u += part_u * (xs * tl.load(su_ptrs + (k // SCALE_BK) * stride_sk)[None, :])
            else:
                acc_u += part_u * xs

    # -- epilogue: the scales a whole sum shares, bias, act (· up), cast, store --------------------------------
    if not K_SCALED:
        acc = acc * tl.load(s_ptrs)[None, :]
        if GATED:
            acc_u = acc_u * tl.load(su_ptrs)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_ACT:
        acc = ACT(acc)
    if GATED:
        acc = acc * acc_u
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False  # the large-M kernel (_fp8_gemm_tma_kernel): W8A8 only, no split
    quant_x: bool = True  # W8A8 split-K, BLOCK_K 128: x quantized in the GEMM, no quantize_rows (default to 16 rows)


QUANT_X_MAX_M = 16  # above, quantizing x again in every N tile costs more than the launch it saves (H100: 64 rows)


@cache
def default_config(M: int, N: int, K: int, gated: bool, a8: bool, device: torch.device) -> Config:
    """Small M: the split-K swap-AB kernel, 16-64 weight rows a program; gate/up (two weights a step) unsplit, down
    split to about two programs per SM (W8A8 to 16 tokens: 4 stages, down 128 rows a program). Larger M, W8A8: the
    TMA kernel, 64 tokens by 64 (to 256 tokens) or 128 columns on 4 warps. W8A16 above 64 tokens: the split-K
    kernel's 64- then 128-row tiles. From an H100 sweep and an H200 one (benchmarks/NOTES.md, FP8 weights)."""
    if INTERPRET:
        return Config(16, 32, 32, min(3, cdiv(K, 32)), 4, 1)
    sms = num_sms(device)
    if M <= 64:
        bm = max(16, triton.next_power_of_2(M))
        qx = M <= QUANT_X_MAX_M
        if gated:
            return Config(bm, 64, 128, 1 if a8 else max(1, min(cdiv(4 * sms, cdiv(N, 64)), cdiv(K, 256), 8)), 4,
                          4 if a8 and bm == 16 else 3, quant_x=qx)
        if a8 and bm == 16 and K >= 8192 and 2 * sms // cdiv(N, 128) <= 16:
            # a down projection's long K: 128-row tiles, two programs per SM (rounded down), 4 stages (an H200 sweep
            # of LLaMA-3-8B's down; shorter K not yet swept)
            return Config(bm, 128, 128, max(1, 2 * sms // cdiv(N, 128)), 4, 4, quant_x=qx)
        tiles = cdiv(M, bm) * cdiv(N, 64)
        return Config(bm, 64, 128, max(1, min(cdiv(2 * sms, tiles), cdiv(K, 2 * 128), 16)), 4, 3, quant_x=qx)
    if a8:
        return Config(64, 64 if M <= 256 else 128, 128, 1, 4, 3 if gated and M > 256 else 4, 8, True)
    bn = 64 if gated else 128
    if M <= 256:
        tiles = cdiv(M, 64) * cdiv(N, bn)
        return Config(64, bn, 128, max(1, min(cdiv(sms, tiles), cdiv(K, 4 * 128), 4)), 4, 3)
    return Config(128, bn, 128, 1, 8, 3)


def fp8_linear(x: Tensor, w: Fp8Weight, up: Fp8Weight | None = None, bias: Tensor | None = None,
               activation: str | None = None, a8: bool = False, config: Config | None = None,
               out_dtype: torch.dtype | None = None, f16: bool = False) -> Tensor:
    """y (M, N) = act(x @ (w·s)ᵀ + bias) [· (x @ (up·s)ᵀ)] for 2-D x (M, K) in bf16/fp16/fp32, any strides.
    ``a8``: quantize x per token and 128-wide K block and multiply in fp8 (needs the fp8 tensor cores)."""
    return linear_plan(x, w, up, bias, activation, a8, config, out_dtype, f16, keep_counters=False)(x, w, up, bias)


def linear_plan(x: Tensor, w: Fp8Weight, up: Fp8Weight | None = None, bias: Tensor | None = None,
                activation: str | None = None, a8: bool = False, config: Config | None = None,
                out_dtype: torch.dtype | None = None, f16: bool = False, keep_counters: bool = True):
    """``fp8_linear`` as a function ``(x, w, up, bias) -> y`` of calls like this one (x's shape, strides, dtype and
    device; each weight's and scale's shape and strides; a bias or none): the config, grids, integers and
    constexprs worked out here, once (a decode step's host time is the launches' argument building).
    ``keep_counters``: split-K's arrival counters are the plan's, zeroed once (the kernel leaves them at 0), rather
    than a memset each call; two calls of one plan must then not run at once on two streams."""
    M, K = x.shape
    N = w.w.shape[0]
    dtype, device = out_dtype or x.dtype, x.device
    gated = up is not None
    if gated and (up.w.shape != w.w.shape or up.w.stride() != w.w.stride() or up.scale.stride() != w.scale.stride()
                  or (up.block_n, up.block_k) != (w.block_n, w.block_k)):
        raise ValueError("mlp_fuser: gate and up FP8 weights must share shape, strides and scale format")
    if M == 0 or N == 0:
        return lambda x, w, up, bias: torch.empty((M, N), device=device, dtype=dtype)
    check_a8(w, a8)
    cfg = config or default_config(M, N, K, gated, a8, device)
    if w.k_scaled and (w.block_k % cfg.block_k or (a8 and A8_BLOCK % cfg.block_k)):
        cfg = cfg._replace(block_k=_divisor(min(w.block_k, A8_BLOCK if a8 else w.block_k), cfg.block_k))
    if a8 and A8_BLOCK % cfg.block_k:
        cfg = cfg._replace(block_k=_divisor(A8_BLOCK, cfg.block_k))
    act = get_activation(activation) if activation is not None else None
    quant_x = a8 and not cfg.tma and cfg.quant_x and cfg.block_k == A8_BLOCK and M <= 64
    quant = _quantize_plan(M, K) if a8 and not quant_x else None
    if cfg.tma and _tma_layout_why_not(w, up, a8, cfg, device) is None:
        fallback = linear_plan(x, w, up, bias, activation, a8, cfg._replace(tma=False), out_dtype, f16)
        return _tma_plan(M, N, K, w, gated, bias is not None, act, cfg, dtype, device, quant, fallback)
    unit = max(cfg.block_k, w.block_k if w.k_scaled else cfg.block_k, A8_BLOCK if a8 else cfg.block_k)
    k_per_split = cdiv(cdiv(K, cfg.split_k), unit) * unit  # a K range never cuts a scale block
    split = cdiv(K, k_per_split)
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    sxm, sxk = (K, 1) if quant is not None else x.stride()  # quantize_rows' output is contiguous
    ints = (M, N, K, k_per_split, sxm, sxk, *w.w.stride(), *w.scale.stride(), N, 1)
    gemm = Prepared(
        _fp8_linear_kernel, (tiles, split),
        SCALE_BN=w.block_n, SCALE_BK=w.block_k if w.k_scaled else A8_BLOCK, K_SCALED=w.k_scaled, A8=a8,
        PRECISION=dot_precision(x.dtype), F16=f16 and not a8, GATED=gated, ACT=act.triton_fn if act else None,
        HAS_ACT=act is not None, HAS_BIAS=bias is not None, SPLIT_K=split, QUANT_X=quant_x, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    n_parts = split * (2 if gated else 1) * M * N
    kept = _zeroed_once(tiles, device) if split > 1 and keep_counters else None

    def splitk(x, w, up, bias):
        y = torch.empty((M, N), device=device, dtype=dtype)
        xq, xs = quant(x) if quant is not None else (x, y)
        if split > 1:
            parts = torch.empty(n_parts, device=device, dtype=torch.float32)
            counters = kept if kept is not None else torch.zeros(tiles, device=device, dtype=torch.int32)
        else:
            parts = counters = y
        u = up if up is not None else w
        gemm(xq, xs, w.w, w.scale, u.w, u.scale, bias if bias is not None else y, y, parts, counters, *ints)
        return y
    return splitk


def _zeroed_once(n: int, device: torch.device) -> Tensor | None:
    """n int32 zeros for a plan to keep (split-K's counters: the kernel sets each back to 0, so they are 0 after every
    call, CUDA-graph replays included), or None while a CUDA graph captures (no eager memset: the caller zeroes per
    call). Made on a thread of its own: Inductor's graph trees route the calling thread's warm-up allocations to the
    graph's pool, which must hold no tensor that outlives the warm-up."""
    if device.type != "cuda":
        return torch.zeros(n, device=device, dtype=torch.int32)
    if torch.cuda.is_current_stream_capturing():
        return None
    made = []

    def make():
        with torch.cuda.device(device):
            made.append(torch.zeros(n, device=device, dtype=torch.int32))
            torch.cuda.current_stream().synchronize()  # zero before any stream of the caller's reads them
    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    return made[0] if made else None


def _quantize_plan(M: int, K: int, rows: int | None = None, scales_t: bool = False):
    """``quantize_rows`` for x of M rows and K columns, its launch worked out once. ``rows`` (at least M): q and s
    that many rows, those past M quantized zeros (as x padded with zeros would give); ``scales_t``: s (rows, ⌈K/128⌉)
    at strides (1, rows), a (⌈K/128⌉, rows) buffer seen transposed (cuBLAS' blockwise layout: no copy to it)."""
    R, kb = M if rows is None else rows, cdiv(K, A8_BLOCK)
    if INTERPRET:
        if R == M and not scales_t:
            return quantize_rows

        def reference(x):  # the same bits and layout in aten (quantize_rows' reason)
            q, s = quantize_rows_reference(torch.nn.functional.pad(x, (0, 0, 0, R - M)))
            return q, (s.t().contiguous().t() if scales_t else s)
        return reference
    bm = 16 if R >= 16 else triton.next_power_of_2(R)
    kernel = Prepared(_quantize_rows_kernel, (cdiv(R, bm), kb), BLOCK_M=bm, BLOCK=A8_BLOCK, num_warps=4)
    strides = (1, R) if scales_t else (kb, 1)

    def quant(x):
        q = torch.empty((R, K), device=x.device, dtype=FP8)
        s = torch.empty_strided((R, kb), strides, device=x.device, dtype=torch.float32)
        kernel(x, q, s, M, R, K, x.stride(0), x.stride(1), *strides)
        return q, s
    return quant


def aten_act_quant(act_fn, gated: bool, quant):
    """(g, u) -> ``quant(act(g) · u)`` in aten, the product in place (u unused where not gated)."""
    def glue(g, u):
        h = act_fn(g)
        return quant(h.mul_(u) if gated else h)
    return glue


def act_quant_plan(M: int, K: int, activation: str, gated: bool, scales_t: bool = False):
    """(g, u) -> ``quantize_rows(act(g) · u)`` (u None where not gated) for g, u (M, K) contiguous, in one launch;
    s as ``_quantize_plan`` lays it out. Under the interpreter (whose bf16 casts truncate) the aten path."""
    act = get_activation(activation)
    if INTERPRET or act.triton_fn is None:
        return aten_act_quant(act.fn, gated, _quantize_plan(M, K, scales_t=scales_t))
    kb = cdiv(K, A8_BLOCK)
    kernel = Prepared(_act_quant_kernel, (cdiv(M, 16), kb), ACT=act.triton_fn, HAS_U=gated, BLOCK_M=16,
                      BLOCK=A8_BLOCK, num_warps=4)
    strides = (1, M) if scales_t else (kb, 1)

    def fused(g, u):
        q = torch.empty((M, K), device=g.device, dtype=FP8)
        s = torch.empty_strided((M, kb), strides, device=g.device, dtype=torch.float32)
        kernel(g, u if gated else g, q, s, M, K, *strides)
        return q, s
    return fused


def tma_why_not(xq: Tensor, w: Fp8Weight, up: Fp8Weight | None, a8: bool, cfg: Config) -> str | None:
    """Why the large-M kernel cannot run this call (None: it can): TMA boxes need host descriptors, a Hopper GPU
    (or the interpreter), fp8 activations, and each operand contiguous, 16-byte aligned, rows of 16-byte multiples;
    a K step within one scale block."""
    return _tma_layout_why_not(w, up, a8, cfg, xq.device, xq) or _tma_pointers_why_not(xq, w, up)


def _tma_layout_why_not(w: Fp8Weight, up: Fp8Weight | None, a8: bool, cfg: Config, device: torch.device,
                        xq: Tensor | None = None) -> str | None:
    """``tma_why_not`` but for the operands' addresses: what a plan's signature decides (without ``xq``: x is the
    quantizer's output, contiguous, its K columns the weights')."""
    if TensorDescriptor is None:
        return "this Triton has no host tensor descriptors"
    if not a8:
        return "W8A16: the activations are not fp8"
    u = up if up is not None else w
    for name, t in (("x", xq if xq is not None else w.w), ("weight", w.w), ("up weight", u.w)):
        if not t.is_contiguous() or t.shape[1] % 16:
            return f"the {name} is no TMA operand (contiguous, 16-byte aligned, rows of 16-byte multiples)"
    if w.k_scaled and w.block_k % cfg.block_k:
        return f"a K step of {cfg.block_k} straddles the weight's {w.block_k}-wide scale blocks"
    if not INTERPRET and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9):
        return "TMA needs a Hopper or newer GPU"
    return None


def _tma_pointers_why_not(xq: Tensor, w: Fp8Weight, up: Fp8Weight | None) -> str | None:
    """``tma_why_not`` for the operands' addresses alone: the part a call of a planned signature can change."""
    for name, t in (("x", xq), ("weight", w.w), ("up weight", up.w if up is not None else w.w)):
        if t.data_ptr() % 16:
            return f"the {name} is no TMA operand (contiguous, 16-byte aligned, rows of 16-byte multiples)"
    return None


def _tma_plan(M: int, N: int, K: int, w: Fp8Weight, gated: bool, has_bias: bool, act, cfg: Config,
              dtype: torch.dtype, device: torch.device, quant, fallback):
    """``linear_plan`` on the large-M kernel, for signatures ``_tma_layout_why_not`` allows: grid, integers and
    constexprs once, each weight's descriptor kept with it (``kept_desc``), x's built per call (its memory is the
    call's), one ``Prepared`` launch. A call whose weight lost its 16-byte alignment runs ``fallback`` (split-K)."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    gemm = Prepared(
        _fp8_gemm_tma_kernel, (cdiv(M, bm) * cdiv(N, bn),),
        SCALE_BN=w.block_n, SCALE_BK=w.block_k if w.k_scaled else A8_BLOCK, K_SCALED=w.k_scaled, GATED=gated,
        ACT=act.triton_fn if act else None, HAS_ACT=act is not None, HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    ints = (M, N, K, *w.scale.stride(), N, 1)  # y is contiguous
    x_box = [bm, bk]

    def tma(x, w, up, bias):
        u = up if up is not None else w
        if w.w.data_ptr() % 16 or u.w.data_ptr() % 16:
            return fallback(x, w, up, bias)
        xq, xs = quant(x)
        y = torch.empty((M, N), device=device, dtype=dtype)
        gemm(TensorDescriptor(xq, [M, K], [K, 1], x_box), xs, kept_desc(w.w, bn, bk), w.scale, kept_desc(u.w, bn, bk),
             u.scale, bias if bias is not None else y, y, *ints)
        return y
    return tma


def _divisor(n: int, at_most: int) -> int:
    """The largest power of two dividing ``n`` and no larger than ``at_most`` (at least 16, tl.dot's minimum)."""
    d = 16
    while d * 2 <= at_most and n % (d * 2) == 0:
        d *= 2
    return d
