"""The whole MLP for small M (decode) in one main launch that streams every weight byte once.

Algorithm: split the work over the intermediate dimension I. Program (i, m) owns h[m-block, i-block]:
  1. full K loop: one x tile (BLOCK_M, BLOCK_K) feeds two tl.dot's, with w_gate and w_up tiles (BLOCK_K, BLOCK_I),
     into two fp32 accumulators (one for a plain MLP);
  2. epilogue in fp32: h = act(gate + b_gate) * (up + b_up), then h is rounded to the weights' dtype (only as
     the operand of the next tl.dot);
  3. loop over O in BLOCK_O chunks: partial = h @ w_down[o-block, i-block]ᵀ, tl.atomic_add'ed into an fp32
     workspace y32 (M, O).
  4. the finish: y32 starts as b_down broadcast (zeros without a bias), filled before the launch, and is
     cast to the output dtype after it: 3 launches (2 for fp32, which returns y32 itself).
Two one-launch finishes were built, measured on the H200 and removed (benchmarks/NOTES.md, small_m v2, v3):
counting arrivals per output tile inside the O loop (v2) stalled the w_down pipeline (2.7x slower), and
counting once per program with the last program finishing the rows (v3) needed a release fence in every
thread and a serial finish: 13% slower at M = 1, worse with M. The two extra launches cost ≈ 1 µs each.
Bytes moved: every weight once (2·I·K + I·O, or I·K + I·O plain) + x read once per I-block (from L2) +
the reduction: cdiv(I, BLOCK_I) · M · O fp32 atomics. The reduction is negligible at M=1 and grows
linearly with M: this kernel is for M ≲ 16-64 (dispatch caps it). Blocks of M are the fastest-varying
program id, so the programs that read the same weight slice run together and share it through L2.
The atomic order makes the last bits of y32 nondeterministic run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..activations import get_activation
from .gemm import dot_precision


@triton.jit
def _fused_mlp_small_m_kernel(
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, wd_ptr, y32_ptr,
    M, K, I, O,
    stride_xm, stride_xk, stride_wgi, stride_wgk, stride_wui, stride_wuk, stride_wdo, stride_wdi, stride_bg, stride_bu,
    ACT: tl.constexpr, HAS_UP: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_pid_m
    pid_i = tl.program_id(0) // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_k = tl.arange(0, BLOCK_K)
    offs_o = tl.arange(0, BLOCK_O)
    mask_m = offs_m < M
    mask_i = offs_i < I

    # -- 1. gate and up slices (BLOCK_M, BLOCK_I), all of K -----------------------------------------------
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    wg_ptrs = wg_ptr + offs_k[:, None] * stride_wgk + offs_i[None, :] * stride_wgi
    wu_ptrs = wu_ptr + offs_k[:, None] * stride_wuk + offs_i[None, :] * stride_wui
    acc_g = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w_mask = (offs_k[:, None] < k_left) & mask_i[None, :]
        acc_g = tl.dot(x, tl.load(wg_ptrs, mask=w_mask, other=0.0), acc_g, input_precision=PRECISION)
        if HAS_UP:
            acc_u = tl.dot(x, tl.load(wu_ptrs, mask=w_mask, other=0.0), acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wgk
        wu_ptrs += BLOCK_K * stride_wuk

    # -- 2. h = act(gate + b_gate) * (up + b_up) in fp32, rounded once for the down projection ---------------
    if HAS_BG:
        acc_g += tl.load(bg_ptr + offs_i * stride_bg, mask=mask_i, other=0.0).to(tl.float32)[None, :]
    h = ACT(acc_g)
    if HAS_UP:
        if HAS_BU:
            acc_u += tl.load(bu_ptr + offs_i * stride_bu, mask=mask_i, other=0.0).to(tl.float32)[None, :]
        h = h * acc_u
    h = tl.where(mask_i[None, :], h, 0.0).to(wd_ptr.dtype.element_ty)

    # -- 3. y32[m-block, :] += h @ w_down[:, i-block]ᵀ, BLOCK_O columns at a time ---------------------------
    wd_ptrs = wd_ptr + offs_i[:, None] * stride_wdi + offs_o[None, :] * stride_wdo  # (BLOCK_I, BLOCK_O)
    y_ptrs = y32_ptr + offs_m[:, None] * O + offs_o[None, :]
    num_o = tl.cdiv(O, BLOCK_O)
    for o in range(0, num_o):
        mask_o = offs_o < O - o * BLOCK_O
        wd = tl.load(wd_ptrs, mask=mask_i[:, None] & mask_o[None, :], other=0.0)
        partial = tl.dot(h, wd, input_precision=PRECISION)
        mask_y = mask_m[:, None] & mask_o[None, :]
        tl.atomic_add(y_ptrs, partial, mask=mask_y, sem="relaxed")
        wd_ptrs += BLOCK_O * stride_wdo
        y_ptrs += BLOCK_O


def _blocks(M: int, I: int, dtype: torch.dtype, device: torch.device) -> dict:  # noqa: E741
    """Block sizes by heuristic (no autotuning: the atomics would need the workspace reset per trial)."""
    if device.type != "cuda":  # the CPU interpreter: small tiles, few numpy ops
        return dict(BLOCK_M=16, BLOCK_I=32, BLOCK_K=32, BLOCK_O=32, num_warps=4)
    BLOCK_M = 16 if M <= 16 else 32
    if dtype == torch.float32:
        # 128-wide I slices unless that leaves SMs idle (I=11008: 86 slices of 128 for 132 SMs -> 172 of 64).
        n_sm = torch.cuda.get_device_properties(device).multi_processor_count
        BLOCK_I = 128 if triton.cdiv(I, 128) * triton.cdiv(M, BLOCK_M) >= n_sm else 64
        return dict(BLOCK_M=BLOCK_M, BLOCK_I=BLOCK_I, BLOCK_K=32, BLOCK_O=32, num_warps=4, num_stages=3)
    # fp16/bf16: measured on the H200 (benchmarks/NOTES.md, v1 sweep): 128-wide I slices with a deep, short-K
    # pipeline stream best (4096x11008 M=1: 71.8 µs vs 84.4 µs for BLOCK_I=64, BLOCK_K=64, 3 stages).
    # Shared memory: 5 stages of (BLOCK_M·64 + 2·64·128)·2 bytes = 170-180 KiB of the H200's 227.
    return dict(BLOCK_M=BLOCK_M, BLOCK_I=128, BLOCK_K=64, BLOCK_O=64, num_warps=4, num_stages=5)


def fused_mlp_small_m(
    x2: Tensor,
    w_gate: Tensor,
    b_gate: Tensor | None,
    w_up: Tensor | None,
    b_up: Tensor | None,
    w_down: Tensor,
    b_down: Tensor | None,
    activation: str,
    *,
    block_sizes: dict | None = None,
) -> Tensor:
    """y (M, O) = down(act(gate(x2)) * up(x2)) (no product when w_up is None), in x2's dtype.

    ``block_sizes`` overrides entries of the heuristic's choice (BLOCK_M/I/K/O, num_warps, num_stages): for
    benchmarks that sweep them.
    """
    act = get_activation(activation)
    M, K = x2.shape
    I, O = w_gate.shape[0], w_down.shape[0]  # noqa: E741
    blocks = {**_blocks(M, I, x2.dtype, x2.device), **(block_sizes or {})}
    if M == 0 or O == 0:
        return torch.empty((M, O), dtype=x2.dtype, device=x2.device)
    y32 = torch.empty((M, O), dtype=torch.float32, device=x2.device)
    if b_down is not None:
        y32.copy_(b_down.expand(M, O))  # the bias is the reduction's starting value
    else:
        y32.zero_()
    wu = w_up if w_up is not None else w_gate  # valid pointers and strides, never read
    bg = b_gate if b_gate is not None else y32
    bu = b_up if b_up is not None else y32
    grid = (triton.cdiv(M, blocks["BLOCK_M"]) * triton.cdiv(I, blocks["BLOCK_I"]),)
    _fused_mlp_small_m_kernel[grid](
        x2, w_gate, bg, wu, bu, w_down, y32,
        M, K, I, O,
        x2.stride(0), x2.stride(1), w_gate.stride(0), w_gate.stride(1), wu.stride(0), wu.stride(1),
        w_down.stride(0), w_down.stride(1), bg.stride(0), bu.stride(0),
        ACT=act.triton_fn, HAS_UP=w_up is not None, HAS_BG=b_gate is not None, HAS_BU=b_up is not None,
        PRECISION=dot_precision(x2.dtype), **blocks,
    )
    return y32 if x2.dtype == torch.float32 else y32.to(x2.dtype)
