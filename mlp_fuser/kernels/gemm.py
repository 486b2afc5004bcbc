"""h = act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up): gate and up in ONE tiled GEMM, act·mul in its epilogue.

Algorithm (the Triton matmul tutorial, with two B operands): program ids are ordered in groups of GROUP_M
rows of tiles so consecutive programs share x row-panels and weight column-panels in L2. Each program owns
one (BLOCK_M, BLOCK_N) tile of h and loops over K in BLOCK_K steps: it loads one x tile and the matching
w_gate and w_up tiles and feeds both tl.dot's from the same x tile into two fp32 accumulators. The epilogue
adds the biases, applies act(gate) * up in fp32 and stores h in x's dtype. With w_up None (a plain MLP)
there is one accumulator and h = act(x @ w1ᵀ + b1).

Bytes moved (ideal, with perfect L2 reuse): x (M·K) + w_gate and w_up (2·I·K) + h (M·I), in x's dtype, versus
the unfused path's extra write and re-read of gate and up (4·M·I) and one more launch. FLOPs: 4·M·I·K
(2·M·I·K plain). Weights and x are read through their strides: (out, in) views of any layout, never copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..activations import get_activation
from .common import INTERPRET, Launcher, aligned, cdiv, dot_precision, k_loop_fits, m_bucket, stand_ins


def _configs() -> list[triton.Config]:
    if INTERPRET:  # the CPU interpreter: one small config, no tuning
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4)]
    c = triton.Config
    return [  # two accumulators per program, so the tiles are half the usual single-GEMM size in N
        c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        c({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
        c({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
        c({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
        c({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
        c({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
        # decode: more, thinner programs, so that every SM streams weights (I = 11008 at BLOCK_N = 32: 344 of them)
        c({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 8}, num_warps=4, num_stages=4),
        c({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=6),
        c({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8}, num_warps=4, num_stages=3),
        c({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 8}, num_warps=4, num_stages=4),
    ]


def suits_m(config: triton.Config, bucket: int) -> bool:
    """Whether a config's BLOCK_M suits M (``bucket``: M rounded up to a power of two): not mostly empty rows."""
    return config.kwargs["BLOCK_M"] <= max(32, 2 * bucket)


def config_fits(config: triton.Config, itemsize: int, bucket: int) -> bool:
    """Whether a config's pipelined tiles fit in shared memory (both weights counted) and it ``suits_m``."""
    c = config.kwargs
    fits = k_loop_fits(config.num_stages, c["BLOCK_M"], c["BLOCK_K"], c["BLOCK_N"], 2, itemsize)
    return fits and suits_m(config, bucket)


def fewer_stages(config: triton.Config, itemsize: int) -> triton.Config | None:
    """``config`` with the most pipeline stages (down to 2) whose tiles fit in shared memory; None if 2 do not."""
    c = config.kwargs
    for stages in range(config.num_stages, 1, -1):
        if k_loop_fits(stages, c["BLOCK_M"], c["BLOCK_K"], c["BLOCK_N"], 2, itemsize):
            return triton.Config(dict(c), num_warps=config.num_warps, num_stages=stages)
    return None


def tuning_configs(configs: list[triton.Config], itemsize: int, bucket: int) -> list[triton.Config]:
    """The configs tuned for this dtype and M bucket: those that fit and suit M; where none does (fp32 at M <= 16:
    every config with BLOCK_M <= 32 is too large at its stages), the ones that suit M with fewer stages."""
    fitting = [c for c in configs if config_fits(c, itemsize, bucket)]
    if fitting:
        return fitting
    suited = [c for c in configs if suits_m(c, bucket)] or configs
    return [f for f in (fewer_stages(c, itemsize) for c in suited) if f is not None]


def _prune(configs, named_args, **kwargs):
    """Skip configs that cannot compile (fp32 tiles too large) or waste most of their rows (BLOCK_M >> M)."""
    return tuning_configs(configs, named_args["x_ptr"].element_size(), named_args["M_BUCKET"])


@triton.jit
def gate_up_acc(
    x_ptr, wg_ptr, wu_ptr, offs_m, offs_n, mask_m, mask_n, K,
    stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk,
    HAS_UP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """x @ w_gateᵀ and x @ w_upᵀ for one (BLOCK_M, BLOCK_N) tile in fp32, over K columns from the given pointers: the
    rows offs_m of x and the weight rows offs_n (= columns of the result). One x tile feeds both dots per K step; the
    weight tiles are read transposed, (BLOCK_K, BLOCK_N), through their strides. acc_u stays 0 without HAS_UP."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    wg_ptrs = wg_ptr + offs_k[:, None] * stride_wgk + offs_n[None, :] * stride_wgn
    wu_ptrs = wu_ptr + offs_k[:, None] * stride_wuk + offs_n[None, :] * stride_wun

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w_mask = (offs_k[:, None] < k_left) & mask_n[None, :]
        acc_g = tl.dot(x, tl.load(wg_ptrs, mask=w_mask, other=0.0), acc_g, input_precision=PRECISION)
        if HAS_UP:
            acc_u = tl.dot(x, tl.load(wu_ptrs, mask=w_mask, other=0.0), acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wgk
        wu_ptrs += BLOCK_K * stride_wuk
    return acc_g, acc_u


@triton.jit
def gate_up_finish(
    acc_g, acc_u, bg_ptr, bu_ptr, offs_n, mask_n, stride_bg, stride_bu,
    ACT: tl.constexpr, HAS_UP: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr,
):
    """The epilogue, all in fp32: h = act(acc_g + b_gate) * (acc_u + b_up) (no product without HAS_UP)."""
    if HAS_BG:
        acc_g += tl.load(bg_ptr + offs_n * stride_bg, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    h = ACT(acc_g)
    if HAS_UP:
        if HAS_BU:
            acc_u += tl.load(bu_ptr + offs_n * stride_bu, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        h = h * acc_u
    return h


@triton.jit
def grouped_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile ``tile``, tiles taken GROUP_M rows of tiles at a time (L2 reuse of the weight
    panels)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % group_m, (tile % in_group) // group_m


@triton.jit
def zero_workspace(zero_ptr, n_zero):
    """Set ``n_zero`` int32 elements at ``zero_ptr`` to 0 (a workspace of the next kernel on the stream, such as
    linear_splitk's arrival counters), 256 at a time: one program's job, which saves that kernel a memset launch."""
    for start in range(0, n_zero, 256):
        offs_z = start + tl.arange(0, 256)
        tl.store(zero_ptr + offs_z, 0, mask=offs_z < n_zero)


@triton.jit
def gate_up_tile(
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, offs_m, offs_n, mask_m, mask_n, K,
    stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk, stride_bg, stride_bu,
    ACT: tl.constexpr, HAS_UP: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of h = act(x @ w_gateᵀ + b_gate) * (x @ w_upᵀ + b_up) in fp32, all of K
    (``gate_up_acc``, then ``gate_up_finish``). Shared by gate_up_act and the small-M kernel; inlined into each."""
    acc_g, acc_u = gate_up_acc(
        x_ptr, wg_ptr, wu_ptr, offs_m, offs_n, mask_m, mask_n, K,
        stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk,
        HAS_UP, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )
    return gate_up_finish(acc_g, acc_u, bg_ptr, bu_ptr, offs_n, mask_n, stride_bg, stride_bu, ACT, HAS_UP, HAS_BG,
                          HAS_BU)


@triton.autotune(
    configs=_configs(), key=["M_BUCKET", "N", "K", "HAS_UP"], prune_configs_by={"early_config_prune": _prune}
)
@triton.jit
def _gate_up_act_kernel(
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, h_ptr, zero_ptr,
    M, N, K,
    n_zero,  # int32 elements at zero_ptr to set to 0 for the next kernel (split-K's counters); 0: none
    M_BUCKET,  # a power of two >= M: the autotuning key, unused by the kernel
    stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk, stride_bg, stride_bu,
    ACT: tl.constexpr, HAS_UP: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # -- grouped ordering of the program ids (L2 reuse) ----------------------------------------------
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    # -- a workspace of the next kernel zeroed here, which saves that kernel a memset launch ------------
    if n_zero > 0:
        if pid == 0:
            zero_workspace(zero_ptr, n_zero)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x and h
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of the weights = columns of h
    mask_m = offs_m < M
    mask_n = offs_n < N
    h = gate_up_tile(
        x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, offs_m, offs_n, mask_m, mask_n, K,
        stride_xm, stride_xk, stride_wgn, stride_wgk, stride_wun, stride_wuk, stride_bg, stride_bu,
        ACT, HAS_UP, HAS_BG, HAS_BU, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )
    h_ptrs = h_ptr + offs_m[:, None] * N + offs_n[None, :]  # h rounded to x's dtype once, at the store
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_launch_gate_up_act = Launcher(_gate_up_act_kernel)


def gate_up_act(
    x2: Tensor, w_gate: Tensor, b_gate: Tensor | None, w_up: Tensor | None, b_up: Tensor | None, activation: str,
    zero: Tensor | None = None,
) -> Tensor:
    """h (M, I) = act(x2 @ w_gateᵀ + b_gate) * (x2 @ w_upᵀ + b_up), in x2's dtype; w_up None: no product.
    ``zero``: a contiguous int32 tensor the kernel sets to 0 on the way (the next kernel's counters)."""
    act = get_activation(activation)
    M, K = x2.shape
    N = w_gate.shape[0]
    h = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        if zero is not None:
            zero.zero_()
        return h
    wu, bg, bu = stand_ins(w_gate, b_gate, w_up, b_up, h)

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)

    (sxm, sxk), (sgn, sgk), (sun, suk) = x2.stride(), w_gate.stride(), wu.stride()
    sbg, sbu, precision = bg.stride(0), bu.stride(0), dot_precision(x2.dtype)
    has_up, has_bg, has_bu = w_up is not None, b_gate is not None, b_up is not None
    n_zero = zero.numel() if zero is not None else 0
    key = (x2.get_device(), x2.dtype, M, N, K, sxm, sxk, sgn, sgk, sun, suk, sbg, sbu, aligned(x2, w_gate, bg, wu, bu),
           act.name, has_up, has_bg, has_bu, precision, n_zero)
    _launch_gate_up_act(
        key, grid,
        x2, w_gate, bg, wu, bu, h, zero if zero is not None else h,
        M, N, K, n_zero, m_bucket(M),
        sxm, sxk, sgn, sgk, sun, suk, sbg, sbu,
        ACT=act.triton_fn, HAS_UP=has_up, HAS_BG=has_bg, HAS_BU=has_bu, PRECISION=precision,
    )
    return h
