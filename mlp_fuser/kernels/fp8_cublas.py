"""W8A8 GEMMs on cuBLAS' blockwise-scaled matmul (torch's scaled_mm: x in 1 x 128 blocks, weights in 128 x 128 blocks,
the scales applied inside its main loop). At prefill sizes it beats the Triton kernels, whose per-K-step scaling
waits on each wgmma (benchmarks/NOTES.md, FP8 weights); the MLP's act · up then runs in aten, between the GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import compat
from ..activations import get_activation
from .fp8 import A8_BLOCK, Fp8Weight, _quantize_plan, act_quant_plan, aten_act_quant, quantize_rows

_RUNS: dict = {}  # CUDA device index -> None (blockwise scaled_mm runs and is right there) or why not


def why_not_format(fw: Fp8Weight) -> str | None:
    """Why cuBLAS' blockwise recipe cannot read this weight as stored, or None."""
    N, K = fw.w.shape
    if (fw.block_n, fw.block_k) != (128, 128):
        return f"scales in {fw.block_n} x {fw.block_k} blocks (cuBLAS reads 128 x 128)"
    if N % 128 or K % 128:
        return f"a weight {(N, K)} not in whole 128-blocks"
    if fw.w.stride(1) != 1:
        return "a weight not row-major"
    return None


def _linear(q: Tensor, s: Tensor, fw: Fp8Weight, out_dtype: torch.dtype) -> Tensor:
    """q (M4, K) fp8 with s (M4, K/128) fp32, M4 a multiple of 4: q·s @ (w·s_w)ᵀ on cuBLAS."""
    kb, sw = fw.scale.shape[1], fw.scale
    if kb % 4 or not sw.is_contiguous():  # F.pad copies even where it adds nothing: a launch a GEMM saved
        sw = F.pad(sw, (0, -kb % 4))
    sw = sw.t()  # (K/128 padded to 4, N/128), as cuBLAS lays out the weight's blocks
    sa = s.t().contiguous().t()  # (M, K/128), outer-dimension-major
    return compat.scaled_mm(q, fw.w.t(), sa, sw, "blockwise", out_dtype)


def _quantized(x: Tensor) -> tuple[Tensor, Tensor]:
    """x's rows padded to a multiple of 4 (cuBLAS' scale layout), quantized per token and 128 columns."""
    pad = -x.shape[0] % 4
    return quantize_rows(F.pad(x, (0, 0, 0, pad)) if pad else x)  # F.pad would copy x even with nothing to add


def linear(x: Tensor, fw: Fp8Weight, bias: Tensor | None = None) -> Tensor:
    """x (M, K) @ Wᵀ + bias in x's dtype, x quantized as transformers' FP8Linear does."""
    M = x.shape[0]
    y = _linear(*_quantized(x), fw, x.dtype)[:M]
    return y if bias is None else y + bias


def mlp(x: Tensor, weights, activation: str, gated: bool) -> Tensor:
    """The (gated) MLP of checked weights ``[(name, Fp8Weight, bias)]`` on x (M, K): gate and up share x's
    quantization; act · up and h's quantization between the GEMMs."""
    def gemm(q, s, fw):
        return _linear(q, s, fw, x.dtype)

    def act_quant(g, u):  # on CUDA the plan's glue kernel, so that planned and unplanned calls give the same bits
        return act_quant_plan(g.shape[0], g.shape[1], activation, gated)(g, u)
    glue = act_quant if x.is_cuda else aten_act_quant(get_activation(activation).fn, gated, quantize_rows)
    return _mlp(x, weights, gated, _quantized, glue, (gemm, gemm, gemm))


def _mlp(x: Tensor, weights, gated: bool, quant_x, act_quant, gemms) -> Tensor:
    """``mlp`` on the given quantizers and (gate, up, down) GEMMs ``(q, s, fw) -> y`` (rows padded to 4 by them);
    ``act_quant(g, u)``: act · up, then h quantized for the down GEMM."""
    M = x.shape[0]
    first, up, down = gemms
    q, s = quant_x(x)
    (_, w1, b1), *rest = weights
    g = first(q, s, w1)
    if b1 is not None:
        g += b1
    u = None
    if gated:
        _, wu, bu = rest[0]
        u = up(q, s, wu)
        if bu is not None:
            u += bu
    _, wd, bd = rest[-1]
    qh = act_quant(g, u)
    del g, u  # each (M, I) intermediate freed as soon as it is used: the peak stays at three of them
    y = down(*qh, wd)
    if y.shape[0] != M:
        y = y[:M]
    return y if bd is None else y + bd


# ---- plans: what a call's signature decides, worked out once -------------------------------------------------


def _gemm_plan(fw: Fp8Weight, dtype: torch.dtype):
    """``_linear`` for weights of ``fw``'s signature: whether their scales need a padded copy is decided once; the
    scales themselves are each call's (a later call of the signature brings another layer's weights)."""
    kb = fw.scale.shape[1]
    if kb % 4 or not fw.scale.is_contiguous():
        pad = (0, -kb % 4)

        def padded(q, s, fw):
            return compat.scaled_mm(q, fw.w.t(), s, F.pad(fw.scale, pad).t(), "blockwise", dtype)
        return padded

    def gemm(q, s, fw):
        return compat.scaled_mm(q, fw.w.t(), s, fw.scale.t(), "blockwise", dtype)
    return gemm


def _quant_plan(M: int, K: int):
    """x (M, K) quantized into M rounded up to 4 rows, x's scales written column-major as cuBLAS reads them."""
    return _quantize_plan(M, K, M + -M % 4, scales_t=True)


def linear_plan(x: Tensor, fw: Fp8Weight):
    """``linear`` for calls like (x, fw): a function of (x, fw, bias)."""
    M, K = x.shape
    quant, gemm = _quant_plan(M, K), _gemm_plan(fw, x.dtype)
    if M % 4 == 0:
        def linear(x, fw, bias):
            y = gemm(*quant(x), fw)
            return y if bias is None else y + bias
        return linear

    def linear_rows(x, fw, bias):
        y = gemm(*quant(x), fw)[:M]
        return y if bias is None else y + bias
    return linear_rows


def mlp_plan(x: Tensor, weights, activation: str, gated: bool):
    """``mlp`` for calls like (x, weights): a function of (x, weights) (each call's weights and biases)."""
    M, K = x.shape
    (_, w1, _), *rest = weights
    wd = rest[-1][1]
    quant_x = _quant_plan(M, K)
    act_quant = act_quant_plan(M + -M % 4, w1.w.shape[0], activation, gated, scales_t=True)
    gemms = (_gemm_plan(w1, x.dtype), _gemm_plan(rest[0][1], x.dtype), _gemm_plan(wd, x.dtype))

    def mlp(x, weights):
        return _mlp(x, weights, gated, quant_x, act_quant, gemms)
    return mlp


def why_not_device(index: int | None) -> str | None:
    """Why blockwise scaled_mm cannot run on this CUDA device (asked once per device: a 256 x 256 product against
    its dequantized float reference), or None."""
    if index not in _RUNS:
        if torch.cuda.is_current_stream_capturing():
            return "not yet probed (the first call is inside a CUDA-graph capture)"
        _RUNS[index] = _probe(torch.device("cuda", index))
    return _RUNS[index]


def refused(index: int | None, error: Exception) -> None:
    """Record that torch's blockwise scaled_mm refused a call on this device: the row is not chosen there again."""
    _RUNS[index] = f"torch's blockwise scaled_mm refused a call here ({type(error).__name__}: {str(error)[:120]})"


def _probe(device: torch.device) -> str | None:
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "cuBLAS' blockwise FP8 recipe is measured on sm90 only"
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn((256, 256), generator=gen, device=device)
    x = torch.randn((8, 256), generator=gen, device=device, dtype=torch.bfloat16)
    from .fp8 import dequantize, quantize_blocks

    fw = Fp8Weight(*quantize_blocks(w), 128, 128)
    try:
        got = linear(x, fw).float()
    except Exception as e:  # noqa: BLE001  (this torch or cuBLAS lacks the recipe: the Triton kernels run)
        return f"torch's blockwise scaled_mm does not run here ({type(e).__name__})"
    q, s = quantize_rows(x)
    want = (q.float().view(8, 2, A8_BLOCK) * s[:, :, None]).reshape(8, 256) @ dequantize(fw).T
    err = ((got - want).norm() / want.norm()).item()
    return None if err < 1e-2 else f"torch's blockwise scaled_mm reads the scales otherwise here (error {err:.1e})"
