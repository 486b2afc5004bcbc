"""FP8 routed experts at decode sizes, W8A8: x quantized inside the gate/up GEMM and h inside the down GEMM (their
K steps one 128-column activation block), the same bits as quantize_rows then the GEMMs, two launches fewer."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import HAS_CUDA, KERNEL_DEVICE, poisoned_empty
from test_fp8_moe import quantized_experts, reference64_a8, routing

from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels import moe as kmoe
from mlp_fuser.reference import rel_err

pytestmark = pytest.mark.usefixtures("exact_fp8_casts")  # conftest: in-kernel float8 casts as the GPU's

DTYPES = [torch.bfloat16] if HAS_CUDA else [torch.float16, torch.float32]  # the interpreter's bf16 tl.dot is wrong
BAR = 2e-2 if HAS_CUDA else 5e-3  # h rounded to x's dtype once, y once


def cfg(block_n: int, block_k: int = 128, **kw) -> dict:
    return {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 1, **kw}


def experts_case(T, k, E, H, I, fmt, seed, dtype):
    """Random float8 gated experts (gate and up on one grid), routing with dropped pairs, x of O(1) outputs."""
    g = torch.Generator().manual_seed(seed)
    block = (32, 128) if fmt == "block" else None
    wgu, sgu, wgu64 = quantized_experts(E, 2 * I, H, fmt, block, g)
    wd, sd, wd64 = quantized_experts(E, H, I, fmt, block, g)
    x = torch.randn(T, H, generator=g) * 4
    ids, wts = routing(g, T, k, E)
    dev = KERNEL_DEVICE
    fgu = K8.fp8_experts(wgu.to(dev), sgu.to(dev), block, gated=True)
    fd = K8.fp8_experts(wd.to(dev), sd.to(dev), block)
    return (x.to(dev, dtype), ids.to(dev), wts.to(dev), fgu, fd), (x.to(dtype), ids, wts, wgu64, wd64)


def counting(monkeypatch):
    """The activations' quantize launches made (moe_experts' quantize_rows, a plan's _quantize_plan)."""
    made = []
    for name in ("quantize_rows", "_quantize_plan"):
        real = getattr(kmoe, name)
        monkeypatch.setattr(kmoe, name, lambda *a, real=real, name=name: made.append(name) or real(*a))
    return made


# (T, k, E, H, I, scales): H and I whole 128-column blocks or cut by them; I not a multiple of BLOCK_N 32 either
CASES = [(1, 2, 4, 256, 128, "block"), (3, 3, 5, 200, 80, "channel"), (5, 4, 3, 384, 96, "block"),
         (9, 2, 8, 256, 80, "block"), (2, 4, 6, 130, 200, "channel")]


@pytest.mark.parametrize("T,k,E,H,I,fmt", CASES)
@pytest.mark.parametrize("path", ["sorted", "sorted_fused", "unsorted"])
def test_quantized_in_the_gemms_gives_quantize_rows_bits(monkeypatch, T, k, E, H, I, fmt, path):
    """BLOCK_K 128 at decode: gate/up quantizing x and down quantizing h themselves equal quantize_rows then the
    GEMMs bit for bit, and the float64 reference of W8A8's semantics; no quantize launch."""
    dtype = DTYPES[(T + I) % len(DTYPES)]
    (x, ids, wts, fgu, fd), ref = experts_case(T, k, E, H, I, fmt, seed=T * 100 + I, dtype=dtype)
    made = counting(monkeypatch)
    args = (x, ids, wts, fgu.w, None, fd.w, None, kmoe.ExpertAct(), False, path)
    with poisoned_empty():
        y = kmoe.moe_experts(*args, {"gate_up": cfg(32), "down": cfg(64)}, scales=(fgu, fd), a8=True)
    assert not made
    old = {"gate_up": cfg(32, QUANT_X=False), "down": cfg(64, QUANT_X=False)}
    assert torch.equal(y, kmoe.moe_experts(*args, old, scales=(fgu, fd), a8=True))
    assert made == ["quantize_rows"] * 2
    expected = reference64_a8(*ref, dtype)
    assert expected.abs().max() > 0.1
    assert rel_err(y.cpu(), expected, math.inf) < BAR


@pytest.mark.parametrize("T,k,E,H,I,fmt", CASES[:3])
def test_sorted_plan_quantizes_in_the_gemms(monkeypatch, T, k, E, H, I, fmt):
    """The sorted FP8 plan at decode: no quantize launch planned, the old plan's output bit for bit, either fused
    alone (x only, h only) too."""
    dtype = DTYPES[T % len(DTYPES)]
    (x, ids, wts, fgu, fd), _ = experts_case(T, k, E, H, I, fmt, seed=T + 7, dtype=dtype)
    made = counting(monkeypatch)
    ys = []
    for qx, qh in ((True, True), (False, False), (True, False), (False, True)):
        configs = {"gate_up": cfg(32, QUANT_X=qx), "down": cfg(32, QUANT_X=qh)}
        plan = kmoe.experts_plan(x, ids, wts, fgu.w, None, fd.w, None, kmoe.ExpertAct(), False, "sorted", configs,
                                 scales=(fgu, fd), a8=True)
        assert made.count("_quantize_plan") == (not qx) + (not qh)
        made.clear()
        with poisoned_empty():
            ys.append(plan(x, ids, wts, fgu.w, None, fd.w, None, (fgu, fd)))
    assert all(torch.equal(ys[0], y) for y in ys[1:])


def test_quantized_in_the_gemm_only_at_decode_on_128_column_steps():
    """The default: to FUSED_QUANT_MAX_PAIRS pairs, where a K step is one 128-column block (BLOCK_K cut by 64-wide
    weight blocks is not), unless the config says."""
    g = torch.Generator().manual_seed(3)
    w, s, _ = quantized_experts(2, 64, 256, "block", (32, 128), g)
    fe = K8.fp8_experts(w, s, (32, 128))
    w64, s64, _ = quantized_experts(2, 64, 256, "block", (32, 64), g)
    fe64 = K8.fp8_experts(w64, s64, (32, 64))
    most = kmoe.FUSED_QUANT_MAX_PAIRS
    assert kmoe.quant_in_gemm(fe, cfg(64), most) and not kmoe.quant_in_gemm(fe, cfg(64), most + 1)
    assert not kmoe.quant_in_gemm(fe, cfg(64, 64), 1) and not kmoe.quant_in_gemm(fe64, cfg(64), 1)
    assert kmoe.quant_in_gemm(fe, cfg(64, 256), 1)  # cut to 128 for the activations' blocks
    assert not kmoe.quant_in_gemm(fe, cfg(64, QUANT_X=False), 1) and kmoe.quant_in_gemm(fe, cfg(64, QUANT_X=True),
                                                                                        most + 1)
