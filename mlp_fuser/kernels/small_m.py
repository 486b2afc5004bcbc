"""The whole MLP for small M (decode) in one main launch that streams every weight byte once.

Algorithm: split the work over the intermediate dimension I. Program (i, m) owns h[m-block, i-block]:
  1. full K loop: one x tile (BLOCK_M, BLOCK_K) feeds two tl.dot's, with w_gate and w_up tiles (BLOCK_K, BLOCK_I),
     into two fp32 accumulators (one for a plain MLP);
  2. epilogue in fp32: h = act(gate + b_gate) * (up + b_up), then h is rounded to the weights' dtype (only as
     the operand of the next tl.dot);
  3. loop over O in BLOCK_O chunks: partial = h @ w_down[o-block, i-block]ᵀ, tl.atomic_add'ed into an fp32
     workspace y32 (M, O).
  4. the finish: y32 is zeroed before the launch; after it, one small kernel adds b_down and casts to the
     output dtype: 3 launches (2 for fp32 without a bias, which returns y32 itself).
Block sizes are autotuned per (M bucket, K, I, O, gated, dtype) over a few configs (BLOCK_I, BLOCK_K, pipeline
depth); Triton's autotuner zeroes y32 before each trial and before the real run.
The finish stays a separate launch: finishing inside this kernel (arrival counters, the last program adds
b_down) is slower (benchmarks/NOTES.md, Small M split over I: finish in the kernel).
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
from .common import INTERPRET, Launcher, aligned, cdiv, dot_precision, k_loop_fits, m_bucket, stand_ins
from .gemm import gate_up_tile


def _configs() -> list[triton.Config]:
    if INTERPRET:  # the CPU interpreter: one small config, no tuning
        return [triton.Config(dict(BLOCK_M=16, BLOCK_I=32, BLOCK_K=32, BLOCK_O=32), num_warps=4)]
    configs = []
    for bm in (16, 32):
        # fp16/bf16 (BLOCK_K >= 64): (BLOCK_I, BLOCK_K, stages), slice width traded against pipeline depth
        for bi, bk, stages in ((128, 64, 5), (128, 128, 3), (64, 128, 5), (64, 64, 6), (128, 128, 5)):
            configs.append(triton.Config(dict(BLOCK_M=bm, BLOCK_I=bi, BLOCK_K=bk, BLOCK_O=64), num_warps=4,
                                         num_stages=stages))
        for bi in (128, 64):  # fp32 (BLOCK_K = 32)
            configs.append(triton.Config(dict(BLOCK_M=bm, BLOCK_I=bi, BLOCK_K=32, BLOCK_O=32), num_warps=4,
                                         num_stages=3))
    return configs


def _prune(configs, named_args, **kwargs):
    """Keep the configs for this dtype and M whose pipelined K-loop tiles fit in shared memory."""
    itemsize = named_args["x_ptr"].element_size()
    block_m = 16 if named_args["M_BUCKET"] <= 16 else 32
    n_w = 2 if kwargs.get("HAS_UP", True) else 1
    keep = []
    for c in configs:
        k = c.kwargs
        fp32_config = k["BLOCK_K"] == 32
        if k["BLOCK_M"] == block_m and fp32_config == (itemsize == 4) \
                and k_loop_fits(c.num_stages, k["BLOCK_M"], k["BLOCK_K"], k["BLOCK_I"], n_w, itemsize):
            keep.append(c)
    return keep or configs[:1]


@triton.autotune(configs=_configs(), key=["M_BUCKET", "K", "I", "O", "HAS_UP"],
                 prune_configs_by={"early_config_prune": _prune}, reset_to_zero=["y32_ptr"])
@triton.jit
def _fused_mlp_small_m_kernel(
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, wd_ptr, y32_ptr,
    M, K, I, O,
    M_BUCKET,  # a power of two >= M: the autotuning key, unused by the kernel
    stride_xm, stride_xk, stride_wgi, stride_wgk, stride_wui, stride_wuk, stride_wdo, stride_wdi, stride_bg, stride_bu,
    ACT: tl.constexpr, HAS_UP: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_pid_m
    pid_i = tl.program_id(0) // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_o = tl.arange(0, BLOCK_O)
    mask_m = offs_m < M
    mask_i = offs_i < I

    # -- 1-2. h[m-block, i-block] = act(gate + b_gate) * (up + b_up) in fp32, all of K; rounded once for the down
    #         projection ------------------------------------------------------------------------------------
    h = gate_up_tile(
        x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, offs_m, offs_i, mask_m, mask_i, K,
        stride_xm, stride_xk, stride_wgi, stride_wgk, stride_wui, stride_wuk, stride_bg, stride_bu,
        ACT, HAS_UP, HAS_BG, HAS_BU, PRECISION, BLOCK_M, BLOCK_I, BLOCK_K,
    )
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


@triton.jit
def _finish_kernel(y32_ptr, b_ptr, y_ptr, n, O, stride_b, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    """y = y32 + b (broadcast over rows), cast to y's dtype; flat over the M·O elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(y32_ptr + offs, mask=mask, other=0.0)
    if HAS_B:
        y += tl.load(b_ptr + (offs % O) * stride_b, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


_launch_small_m = Launcher(_fused_mlp_small_m_kernel)
_launch_finish = Launcher(_finish_kernel)


def fused_mlp_small_m(
    x2: Tensor,
    w_gate: Tensor,
    b_gate: Tensor | None,
    w_up: Tensor | None,
    b_up: Tensor | None,
    w_down: Tensor,
    b_down: Tensor | None,
    activation: str,
) -> Tensor:
    """y (M, O) = down(act(gate(x2)) * up(x2)) (no product when w_up is None), in x2's dtype."""
    act = get_activation(activation)
    M, K = x2.shape
    I, O = w_gate.shape[0], w_down.shape[0]
    if M == 0 or O == 0:
        return torch.empty((M, O), dtype=x2.dtype, device=x2.device)
    y32 = torch.zeros((M, O), dtype=torch.float32, device=x2.device)
    wu, bg, bu = stand_ins(w_gate, b_gate, w_up, b_up, y32)

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(I, meta["BLOCK_I"]),)

    (sxm, sxk), (sgi, sgk), (sui, suk), (sdo, sdi) = x2.stride(), w_gate.stride(), wu.stride(), w_down.stride()
    sbg, sbu, precision = bg.stride(0), bu.stride(0), dot_precision(x2.dtype)
    has_up, has_bg, has_bu = w_up is not None, b_gate is not None, b_up is not None
    device = x2.get_device()
    key = (device, x2.dtype, M, K, I, O, sxm, sxk, sgi, sgk, sui, suk, sdo, sdi, sbg, sbu,
           aligned(x2, w_gate, bg, wu, bu, w_down), act.name, has_up, has_bg, has_bu, precision)
    _launch_small_m(
        key, grid,
        x2, w_gate, bg, wu, bu, w_down, y32,
        M, K, I, O, m_bucket(M),
        sxm, sxk, sgi, sgk, sui, suk, sdo, sdi, sbg, sbu,
        ACT=act.triton_fn, HAS_UP=has_up, HAS_BG=has_bg, HAS_BU=has_bu, PRECISION=precision,
    )
    if x2.dtype == torch.float32 and b_down is None:
        return y32
    y = torch.empty((M, O), dtype=x2.dtype, device=x2.device)
    BLOCK = 1024
    has_b = b_down is not None
    b = b_down if has_b else y32
    sb = b.stride(0) if has_b else 0
    _launch_finish(
        (device, x2.dtype, M, O, sb, aligned(b), has_b), (cdiv(M * O, BLOCK),),
        y32, b, y, M * O, O, sb,
        HAS_B=has_b, BLOCK=BLOCK, num_warps=4,
    )
    return y
