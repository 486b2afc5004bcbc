"""The MLP's backward through the activation, in the epilogue of the dh = dy @ w_down GEMM.

With g = x @ w_gateᵀ + b_gate and u = x @ w_upᵀ + b_up (the pre-activations, saved or recomputed), a = act(g),
h = a * u and y = h @ w_downᵀ + b_down:

    dh = dy @ w_down                 (M, I), accumulated in fp32, never stored
    dg = dh * act'(g) * u            du = dh * a             (plain MLP: dg = dh * act'(g), no du)
    h  = a * u                       only where dW_down = dyᵀ @ h is needed

Algorithm: the Triton matmul tutorial over (M, I) tiles of dh, grouped program ordering for L2 reuse; each program
loops over O in BLOCK_K steps (a dy tile and a w_down tile, read through its strides), then its epilogue loads
the g (and u) tile, applies act and act' in fp32 and stores dg and du side by side in one (M, 2I) tensor ``dgu``
(dg in columns [0, I), du in [I, 2I)), so that d(w_gate | w_up) = dguᵀ @ x and the bias gradients dgu.sum(0) are
one GEMM and one reduction over the pair. Everything is rounded to the output dtype once, at the store.

Bytes (bf16): dy (M·O) + w_down (O·I) + g, u (2·M·I) read; dgu (2·M·I) + h (M·I) written. The aten backward moves
dh (M·I) twice more and runs ~8 elementwise passes over (M, I) tensors (a, act'(g), products), each 2-3 · M·I.
FLOPs: 2·M·I·O, as the plain dh GEMM.

``act_mul_backward`` is the same epilogue as a pass of its own after a cuBLAS dh (flat over M·I elements, for
contiguous dh, g and u): dh written and read once more (2·M·I) but the GEMM is cuBLAS's. Which of the two is faster
depends on how close the Triton GEMM comes to cuBLAS at the shape; dispatch times both per shape on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..activations import get_activation
from .common import INTERPRET, Launcher, aligned, cdiv, dot_precision, k_loop_fits, m_bucket
from .gemm import grouped_tile


def _configs() -> list[triton.Config]:
    if INTERPRET:  # the CPU interpreter: one small config, no tuning
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4)]
    c = triton.Config
    # One accumulator, but the epilogue holds two more fp32 tiles (g, u): 128 x 128 at 8 warps is ~200 registers
    # per thread; 128 x 256 tiles would spill there.
    return [
        c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        c({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
        c({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
        c({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
        c({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
    ]


def _prune(configs, named_args, **kwargs):
    """Skip configs whose pipelined tiles do not fit in shared memory or whose BLOCK_M is far above M."""
    itemsize, bucket = named_args["dy_ptr"].element_size(), named_args["M_BUCKET"]
    fitting = [c for c in configs
               if k_loop_fits(c.num_stages, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"], c.kwargs["BLOCK_N"], 1, itemsize)
               and c.kwargs["BLOCK_M"] <= max(32, 2 * bucket)]
    return fitting or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])]


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "HAS_U", "STORE_H"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _mlp_backward_kernel(
    dy_ptr, wd_ptr, g_ptr, u_ptr, dgu_ptr, h_ptr,
    M, N, K,  # N = I (columns of dh), K = O (the reduction: dh = dy @ w_down)
    M_BUCKET,  # a power of two >= M: the autotuning key, unused by the kernel
    stride_dym, stride_dyk, stride_wdk, stride_wdn, stride_gm, stride_gn, stride_um, stride_un, stride_dgum,
    ACT: tl.constexpr, ACT_GRAD: tl.constexpr, HAS_U: tl.constexpr, STORE_H: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # -- grouped ordering of the program ids (L2 reuse) ----------------------------------------------
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of dy, g, u, dgu
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of w_down = columns of dh
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # -- dh tile = dy[offs_m, :] @ w_down[:, offs_n], fp32 ----------------------------------------------
    dy_ptrs = dy_ptr + offs_m[:, None] * stride_dym + offs_k[None, :] * stride_dyk
    wd_ptrs = wd_ptr + offs_k[:, None] * stride_wdk + offs_n[None, :] * stride_wdn
    dh = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        dy = tl.load(dy_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        wd = tl.load(wd_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        dh = tl.dot(dy, wd, dh, input_precision=PRECISION)
        dy_ptrs += BLOCK_K * stride_dyk
        wd_ptrs += BLOCK_K * stride_wdk

    # -- epilogue, all in fp32: the activation's derivative and the product ---------------------------------
    mask = mask_m[:, None] & mask_n[None, :]
    g = tl.load(g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn, mask=mask, other=0.0)
    g = g.to(tl.float32)
    a = ACT(g)
    dg = dh * ACT_GRAD(g)
    row = dgu_ptr + offs_m[:, None] * stride_dgum  # dgu's rows: d(g) in columns [0, N), d(u) in [N, 2N)
    if HAS_U:
        u = tl.load(u_ptr + offs_m[:, None] * stride_um + offs_n[None, :] * stride_un, mask=mask, other=0.0)
        u = u.to(tl.float32)
        tl.store(row + offs_n[None, :], (dg * u).to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(row + N + offs_n[None, :], (dh * a).to(dgu_ptr.dtype.element_ty), mask=mask)
        a = a * u  # h
    else:
        tl.store(row + offs_n[None, :], dg.to(dgu_ptr.dtype.element_ty), mask=mask)
    if STORE_H:
        tl.store(h_ptr + offs_m[:, None] * N + offs_n[None, :], a.to(h_ptr.dtype.element_ty), mask=mask)


_launch = Launcher(_mlp_backward_kernel)


def mlp_backward(dy: Tensor, w_down: Tensor, g: Tensor, u: Tensor | None, activation: str,
                 need_h: bool) -> tuple[Tensor, Tensor | None]:
    """(dgu, h) from dy (M, O), w_down (O, I) and the pre-activations g, u (M, I), any strides: dgu (M, 2I) holds
    d(g) in its first I columns and d(u) in the rest ((M, I), d(g) only, when u is None); h = act(g) * u (M, I)
    when ``need_h``, else None. Both contiguous, in dy's dtype."""
    act = get_activation(activation)
    M, O = dy.shape
    I = g.shape[1]
    dgu = torch.empty((M, 2 * I if u is not None else I), dtype=dy.dtype, device=dy.device)
    h = torch.empty((M, I), dtype=dy.dtype, device=dy.device) if need_h else None
    if M == 0 or I == 0:
        return dgu, h
    uu = u if u is not None else g  # a valid pointer, never read
    hh = h if h is not None else dgu

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(I, meta["BLOCK_N"]),)

    (sym, syk), (swk, swn), (sgm, sgn), (sum_, sun) = dy.stride(), w_down.stride(), g.stride(), uu.stride()
    precision = dot_precision(dy.dtype)
    key = (dy.get_device(), dy.dtype, M, I, O, sym, syk, swk, swn, sgm, sgn, sum_, sun,  # (dgu's row stride: I, u)
           aligned(dy, w_down, g, uu, dgu, hh), act.name, u is not None, need_h, precision)
    _launch(
        key, grid,
        dy, w_down, g, uu, dgu, hh,
        M, I, O, m_bucket(M),
        sym, syk, swk, swn, sgm, sgn, sum_, sun, dgu.stride(0),
        ACT=act.triton_fn, ACT_GRAD=act.triton_grad, HAS_U=u is not None, STORE_H=need_h, PRECISION=precision,
    )
    return dgu, h


@triton.jit
def _act_mul_backward_kernel(
    dh_ptr, g_ptr, u_ptr, dgu_ptr, h_ptr,
    n, N,  # n = M·N elements of dh, g, u (all contiguous); N = I, the row length
    ACT: tl.constexpr, ACT_GRAD: tl.constexpr, HAS_U: tl.constexpr, STORE_H: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = ACT(g)
    dg = dh * ACT_GRAD(g)
    if HAS_U:
        row, col = offs // N, offs % N
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dgu_ptr + row * 2 * N + col, (dg * u).to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + row * 2 * N + N + col, (dh * a).to(dgu_ptr.dtype.element_ty), mask=mask)
        a = a * u
    else:
        tl.store(dgu_ptr + offs, dg.to(dgu_ptr.dtype.element_ty), mask=mask)
    if STORE_H:
        tl.store(h_ptr + offs, a.to(h_ptr.dtype.element_ty), mask=mask)


_launch_elementwise = Launcher(_act_mul_backward_kernel)
act_mul_backward_launcher = _launch_elementwise  # plans.build_backward recognises the default backward's launch by it
FLAT = dict(BLOCK=1024, num_warps=4)


def act_mul_backward(dy: Tensor, w_down: Tensor, g: Tensor, u: Tensor | None, activation: str,
                     need_h: bool) -> tuple[Tensor, Tensor | None]:
    """``mlp_backward``'s result with dh = dy @ w_down from cuBLAS (torch.mm, rounded to dy's dtype) and the epilogue
    as one elementwise pass. g and u must be contiguous."""
    act = get_activation(activation)
    M, I = g.shape
    dh = dy.mm(w_down)
    dgu = torch.empty((M, 2 * I if u is not None else I), dtype=dy.dtype, device=dy.device)
    h = torch.empty((M, I), dtype=dy.dtype, device=dy.device) if need_h else None
    if M == 0 or I == 0:
        return dgu, h
    if not (g.is_contiguous() and (u is None or u.is_contiguous())):
        raise ValueError("act_mul_backward: g and u must be contiguous")
    uu = u if u is not None else g  # a valid pointer, never read
    hh = h if h is not None else dgu
    key = (dy.get_device(), dy.dtype, M, I, aligned(dh, g, uu, dgu, hh), act.name, u is not None, need_h)
    _launch_elementwise(key, (cdiv(M * I, FLAT["BLOCK"]),), dh, g, uu, dgu, hh, M * I, I,
                        ACT=act.triton_fn, ACT_GRAD=act.triton_grad, HAS_U=u is not None, STORE_H=need_h, **FLAT)
    return dgu, h
