"""What each row of the dense op's table (``dispatch/dense.py``) runs: the Triton kernels and cuBLAS calls composed
into one MLP, each called as ``fn(x2, wg, bg, wu, bu, wd, bd, activation)`` on x flattened to 2-D (the backward's
as ``fn(dy, w_down, g, u, activation, need_h)``). The dispatcher chooses among them; launch plans record them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import act_mul, gate_up_act, quack_gated
from ..kernels.backward import act_mul_backward
from ..kernels.common import gate_up_as_one
from ..kernels.splitk import linear_splitk, splitk_config, splitk_counters
from ..kernels.swapab import gate_up_act_swapab

ImplFn = Callable[..., Tensor]


def triton_gemm(x2, wg, bg, wu, bu, wd, bd, act):
    return F.linear(gate_up_act(x2, wg, bg, wu, bu, act), wd, bd)


def then_splitk_down(gate_up) -> ImplFn:
    """The MLP as ``gate_up`` (gate_up_act's contract; it zeroes the split-K kernel's counters on its way), then the
    split-K down GEMM: two launches."""
    def impl(x2, wg, bg, wu, bu, wd, bd, act):
        M, (O, I) = x2.shape[0], wd.shape
        config = splitk_config(M, O, I, x2.element_size(), x2.device)
        counters = splitk_counters(M, O, I, config, x2.device)
        return linear_splitk(gate_up(x2, wg, bg, wu, bu, act, zero=counters), wd, bd, config, counters=counters)
    return impl


triton_gemm_splitk = then_splitk_down(gate_up_act)
triton_swapab = then_splitk_down(gate_up_act_swapab)


def one_gemm_act_mul(x2, wgu, wd, bd, act):
    """Gate and up stored as one weight (``wgu``, their (2I, K) view): one GEMM for both, act·mul on its halves."""
    I = wgu.shape[0] // 2
    gu = F.linear(x2, wgu)
    return F.linear(act_mul(gu[:, :I], gu[:, I:], act), wd, bd)


def cublas_act_mul(x2, wg, bg, wu, bu, wd, bd, act):
    wgu = gate_up_as_one(wg, bg, wu, bu)
    if wgu is not None:
        return one_gemm_act_mul(x2, wgu, wd, bd, act)
    g = F.linear(x2, wg, bg)
    u = F.linear(x2, wu, bu) if wu is not None else None
    return F.linear(act_mul(g, u, act), wd, bd)


def quack_gated_mlp(config: str) -> ImplFn:
    """quack's gated GEMM (tile config ``config``) for gate and up stored as one, then cuBLAS for down."""
    def impl(x2, wg, bg, wu, bu, wd, bd, act):
        wgu = gate_up_as_one(wg, bg, wu, bu)
        if wgu is None:  # forced onto weights it cannot take (the dispatcher only times it where they are one)
            raise ValueError("mlp_fuser: quack_gated needs gate and up stored as one weight without biases")
        return F.linear(quack_gated.gated_act(x2, wgu, act, config), wd, bd)
    return impl


_side_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the stream cublas_two_streams runs up on


def cublas_two_streams(x2, wg, bg, wu, bu, wd, bd, act):
    """``cublas_act_mul`` with the up GEMM on a second stream, beside the gate GEMM: at M = 32-256 each of the two
    leaves SMs idle, and side by side they fill them (faster in CUDA graphs, slower in plain calls by the host's stream
    switches: benchmarks/NOTES.md, two streams). The fork and the join are stream waits, so a CUDA-graph capture records
    two branches; u is allocated on the caller's stream, which waits for the side stream before anything reads u or
    frees x, u or the weights."""
    if not x2.is_cuda or wu is None:  # the interpreter's CPU runs, or (forced) a plain MLP: one stream
        return cublas_act_mul(x2, wg, bg, wu, bu, wd, bd, act)
    wgu = gate_up_as_one(wg, bg, wu, bu)
    if wgu is not None:  # stored as one: one stream, whose one GEMM fills the GPU as the two side by side would
        return one_gemm_act_mul(x2, wgu, wd, bd, act)
    here = torch.cuda.current_stream(x2.device)
    side = _side_streams.get(x2.device.index)
    if side is None:
        side = _side_streams[x2.device.index] = torch.cuda.Stream(x2.device)
    u = torch.empty((x2.shape[0], wu.shape[0]), dtype=x2.dtype, device=x2.device)
    side.wait_stream(here)  # x, and u's memory, are ready
    with torch.cuda.stream(side):
        torch.mm(x2, wu.t(), out=u) if bu is None else torch.addmm(bu, x2, wu.t(), out=u)
    g = F.linear(x2, wg, bg)
    here.wait_stream(side)  # u is written
    return F.linear(act_mul(g, u, act), wd, bd)


def cublas_backward(dy, wd, g, u, act, need_h):
    return act_mul_backward(dy, wd, g.contiguous(), u.contiguous() if u is not None else None, act, need_h)
