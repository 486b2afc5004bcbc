"""The MoE router's softmax → top-k → renormalise → cast, as one kernel after the router's GEMM.

transformers' routers (``Qwen3MoeTopKRouter``, Mixtral's, OLMoE's, ...) run ``softmax(logits, dtype=float32)``,
``topk``, an optional division by the top-k sum and a cast back: a softmax, a gather and a sort kernel, two more
elementwise ones, about 15 µs of a decode step per layer even under Inductor. Here each program takes BLOCK_T
tokens, each token's E logits whole in registers, and picks the k largest probabilities in k passes of "the largest
left, the lowest index among equals" (the order ``torch.topk`` returns them in).

Block shapes: BLOCK_E = E rounded up to a power of two (E ≤ MAX_E), BLOCK_T = tokens per program, so that a
program holds about 4096 logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import Launcher, aligned, cdiv, next_power_of_2

MAX_E = 1024  # experts: each token's row stays in registers
MAX_K = 64


@triton.jit
def _router_topk_kernel(logits_ptr, wts_ptr, ids_ptr, T, E, stride_t, K_TOP: tl.constexpr, RENORM: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    valid = (rows[:, None] < T) & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.where(rows[:, None] < T, x, 0.0)  # rows past T: no -inf minus -inf
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = tl.where(valid, p, 0.0)
    total = tl.sum(p, 1)
    p = p / tl.where(total > 0, total, 1.0)[:, None]
    p = tl.where(valid, p, -1.0)  # below every probability: never taken
    slots = tl.arange(0, BLOCK_K)
    vals = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    idx = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K_TOP):
        v = tl.max(p, 1)
        first = tl.min(tl.where(p == v[:, None], cols[None, :], BLOCK_E), 1)  # the lowest index holding the max
        vals = tl.where(slots[None, :] == j, v[:, None], vals)
        idx = tl.where(slots[None, :] == j, first[:, None], idx)
        p = tl.where(cols[None, :] == first[:, None], -1.0, p)
    if RENORM:
        vals = vals / tl.sum(vals, 1)[:, None]  # the unused slots hold 0
    out = rows[:, None] * K_TOP + slots[None, :]
    keep = (rows[:, None] < T) & (slots[None, :] < K_TOP)
    tl.store(wts_ptr + out, vals.to(wts_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, idx.to(tl.int64), mask=keep)


_launch = Launcher(_router_topk_kernel)


def why_not(E: int, k: int) -> str | None:
    """None where the kernel runs E experts' logits with top ``k``, else why not."""
    if not 1 <= k <= min(E, MAX_K):
        return f"top-k {k} outside 1..{min(E, MAX_K)}"
    if E > MAX_E:
        return f"{E} experts > {MAX_E}"
    return None


def router_topk(logits: Tensor, k: int, renorm: bool, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(weights (T, k) in ``out_dtype``, ids (T, k) int64) of 2-D ``logits`` (T, E) with a unit last stride: softmax
    in fp32, the k largest in descending order, divided by their sum where ``renorm``."""
    T, E = logits.shape
    wts = torch.empty((T, k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    if T == 0:
        return wts, ids
    BLOCK_E = next_power_of_2(E)
    BLOCK_T = max(1, min(next_power_of_2(T), 4096 // BLOCK_E))
    BLOCK_K = next_power_of_2(k)
    stride = logits.stride(0)
    key = (logits.get_device(), logits.dtype, out_dtype, T, E, stride, k, renorm, aligned(logits, wts, ids))
    _launch(key, (cdiv(T, BLOCK_T),), logits, wts, ids, T, E, stride,
            K_TOP=k, RENORM=renorm, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=BLOCK_K, num_warps=4)
    return wts, ids
