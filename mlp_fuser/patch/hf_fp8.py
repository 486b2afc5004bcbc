"""transformers' own FP8 forward, run anywhere: an aten stand-in for its Hub kernel ``finegrained-fp8``.

transformers' ``FP8Linear`` and ``FP8Experts`` call that kernel's ``matmul`` / ``batched_matmul`` /
``grouped_matmul``, fetched from the Hub on first use (never offline, never on the CPU). ``aten_kernel()`` computes
what it computes: the activations quantized per token and per block of the weight's K block size (amax / 448; 128
columns where the weight has no blocks), or by a static per-tensor ``activation_scale``, times the dequantized
weight, accumulated in fp32, returned in the activations' dtype. Inside ``transformers_fp8_in_aten()``
transformers' FP8 layers run their own code on it: the FP8 reference the benchmarks compare tokens and logits
with, and the accuracy tests' "transformers' FP8 semantics". A reference, not a fast path: each call dequantizes
the weights it reads.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import compat
from ..kernels import fp8 as K8


def _x(x2: Tensor, group: int, activation_scale: Tensor | None) -> Tensor:
    """The activations (M, K) as the kernel multiplies them, in fp32: quantized per token and ``group`` columns
    (amax / 448), or by the static per-tensor scale, then scaled back."""
    if activation_scale is not None:
        s = activation_scale.float()
        return (x2.float() / s).clamp(-K8.FP8_MAX, K8.FP8_MAX).to(K8.FP8).float() * s
    M, K = x2.shape
    xb = F.pad(x2.float(), (0, (-K) % group)).view(M, -1, group)
    s = xb.abs().amax(-1, keepdim=True).clamp(min=1e-12) / K8.FP8_MAX
    return ((xb / s).clamp(-K8.FP8_MAX, K8.FP8_MAX).to(K8.FP8).float() * s).view(M, -1)[:, :K]


def _grid(w: Tensor, s: Tensor, bn: int, bk: int) -> Tensor:
    N, K = w.shape
    return w.float() * s.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]


def _w(w: Tensor, s: Tensor, block_size) -> tuple[Tensor, int]:
    """(the dequantized weight in fp32, the activations' quantization group: the weight's K block, else 128)."""
    N, K = w.shape
    block = tuple(int(b) for b in block_size) if block_size is not None else None
    if block is None or block == (N, K):  # per tensor or channel (transformers may give the whole shape as block)
        if s.numel() not in (1, N):
            raise ValueError(f"the aten stand-in reads per-tensor or per-channel scales here, not {tuple(s.shape)}")
        return w.float() * s.float().reshape(-1, 1), K8.A8_BLOCK
    bn, bk = block
    if s.shape[0] != K8.cdiv(N, bn) and N % 2 == 0 and s.shape[0] == 2 * K8.cdiv(N // 2, bn):
        half = s.shape[0] // 2  # an expert's gate and up, quantized apart then stacked
        return torch.cat([_grid(w[:N // 2], s[:half], bn, bk), _grid(w[N // 2:], s[half:], bn, bk)]), bk
    return _grid(w, s.reshape(K8.cdiv(N, bn), K8.cdiv(K, bk)), bn, bk), bk


def matmul(input: Tensor, weight: Tensor, weight_scale_inv: Tensor, block_size=None, output_dtype=None,
           activation_scale: Tensor | None = None) -> Tensor:
    """``input (..., K) @ weightᵀ`` as the kernel's ``matmul_2d``."""
    wd, bk = _w(weight, weight_scale_inv, block_size)
    x2 = input.reshape(-1, input.shape[-1])
    y = _x(x2, bk, activation_scale) @ wd.T
    return y.to(output_dtype or input.dtype).reshape(*input.shape[:-1], weight.shape[0])


def _every_expert(x: Tensor, w: Tensor, ws: Tensor, block_size, ids: Tensor, activation_scale) -> Tensor:
    """Each row times its expert's weight, every expert computed for every row: no host sync, so Dynamo traces it
    (``explain``'s capture); E times the work."""
    out = x.new_zeros(x.shape[0], w.shape[1])
    for e in range(w.shape[0]):
        out = torch.where((ids == e)[:, None], matmul(x, w[e], ws[e], block_size, x.dtype, activation_scale), out)
    return out


def batched_matmul(x: Tensor, w: Tensor, ws: Tensor, block_size=None, expert_ids: Tensor = None,
                   activation_scale: Tensor | None = None) -> Tensor:
    """Row i of ``x`` (S, K) times expert ``expert_ids[i]``'s weight (E, N, K); rows of no expert (ids ≥ E) zero."""
    if torch.compiler.is_compiling():
        return _every_expert(x, w, ws, block_size, expert_ids, activation_scale)
    out = x.new_zeros(x.shape[0], w.shape[1])
    for e in expert_ids.unique().tolist():
        if 0 <= e < w.shape[0]:
            rows = (expert_ids == e).nonzero().squeeze(1)
            out[rows] = matmul(x[rows], w[e], ws[e], block_size, x.dtype, activation_scale)
    return out


def grouped_matmul(x: Tensor, w: Tensor, ws: Tensor, offsets: Tensor = None, tokens_per_expert: Tensor = None,
                   block_size=None, activation_scale: Tensor | None = None) -> Tensor:
    """``x`` (S, K) sorted by expert, expert e's rows ending at ``offsets[e]``, each times its expert's weight; rows
    past the last offset (no expert) zero."""
    if torch.compiler.is_compiling():
        rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
        return _every_expert(x, w, ws, block_size, torch.searchsorted(offsets, rows, right=True), activation_scale)
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = matmul(x[start:end], w[e], ws[e], block_size, x.dtype, activation_scale)
        start = end
    return out


def aten_kernel():
    """The stand-in as transformers holds a loaded kernel (``FineGrainedFP8``)."""
    from transformers.integrations import finegrained_fp8 as hf

    return hf.FineGrainedFP8(matmul=matmul, batched_matmul=batched_matmul, grouped_matmul=grouped_matmul)


@contextlib.contextmanager
def transformers_fp8_in_aten():
    """Inside the block transformers' FP8 layers run on the aten stand-in (whatever kernel they had is back after)."""
    from transformers.integrations import finegrained_fp8 as hf

    with compat.hf_fp8_kernel_as(hf, aten_kernel()):
        yield
