"""The FP8 table's cuBLAS row (``kernels/fp8_cublas.py``): which calls it takes and why not, its glue around torch's
blockwise scaled_mm checked on the CPU against a float64 reading of that recipe, and the real thing on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE

import mlp_fuser
from mlp_fuser.dispatch import fp8
from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels import fp8_cublas
from mlp_fuser.kernels.common import INTERPRET
from mlp_fuser.ops import quant
from mlp_fuser.reference import rel_err

CUDA = torch.cuda.is_available()


def weight(N, K, g, block=(128, 128), device="cpu"):
    w = (torch.randn(N, K, generator=g) * 2).to(K8.FP8)
    s = torch.rand(K8.cdiv(N, block[0]), K8.cdiv(K, block[1]), generator=g) * 0.02 + 0.005
    return K8.fp8_weight(w.to(device), s.to(device), block)


def fake_scaled_mm(a, b, scale_a, scale_b, recipe, out_dtype):
    """torch's blockwise recipe read in float64: a (M, K) · scale_a[m, k // 128], b (K, N) · scale_b[k // 128, n // 128]
    (scales possibly padded past K's blocks)."""
    assert recipe == "blockwise" and a.shape[0] % 4 == 0
    (M, K), N = a.shape, b.shape[1]
    kb, kb4 = K8.cdiv(K, 128), K8.cdiv(K, 512) * 4  # torch's checks (ScaledBlas.cpp, block 1x128 / 128x128)
    assert scale_a.shape == (M, kb) and (scale_a.stride() == (1, M) or kb == 1)
    assert scale_b.shape == (kb4, K8.cdiv(N, 128)) and scale_b.stride()[0] == 1 and scale_b.stride()[1] == kb4
    sa = scale_a[:, :K // 128].double().repeat_interleave(128, 1)
    sb = scale_b[:K // 128, :N // 128].double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return ((a.double() * sa) @ (b.double() * sb)).to(out_dtype)


def lin64(t, fw):
    """t @ Wᵀ in float64 as transformers' W8A8 computes it: t quantized per token and 128 columns."""
    q, s = K8.quantize_rows_reference(t)
    return (q.double() * s.double().repeat_interleave(128, 1)) @ K8.dequantize(fw, torch.float64).T


def aten_w8a8(x, fws, gated):
    """The (gated) silu MLP with transformers' W8A8 semantics in float64 (h rounded to x's dtype between)."""
    g = lin64(x, fws[0])
    h = torch.nn.functional.silu(g) * lin64(x, fws[1]) if gated else torch.nn.functional.silu(g)
    return lin64(h.to(x.dtype), fws[-1])


def test_why_not_format_and_the_weight_it_names():
    g = torch.Generator().manual_seed(0)
    assert fp8_cublas.why_not_format(weight(256, 384, g)) is None
    assert "64 x 128 blocks" in fp8_cublas.why_not_format(weight(256, 384, g, block=(64, 128)))
    assert "not in whole 128-blocks" in fp8_cublas.why_not_format(weight(200, 384, g))
    per_channel = K8.fp8_weight(torch.randn(256, 384).to(K8.FP8), torch.rand(256))
    assert "1 x 384 blocks" in fp8_cublas.why_not_format(per_channel)
    weights = [("w_gate", weight(256, 384, g), None), ("w_down", weight(384, 200, g, block=(128, 128)), None)]
    assert fp8.cublas_format(weights).startswith("w_down: ")


def test_the_table_takes_cublas_from_128_rows_where_it_reads_the_weights(monkeypatch):
    monkeypatch.setattr(fp8, "why_not_kernels", lambda device, index: None)  # as on an sm90 GPU
    monkeypatch.setattr(fp8_cublas, "why_not_device", lambda index: None)
    p = fp8.Problem("cuda", torch.bfloat16, 2048, 0, None)
    assert fp8.choose(p).name == "fp8_cublas_blockwise"
    assert fp8.choose(p._replace(M=128)).name == "fp8_cublas_blockwise"
    small = p._replace(M=64)
    assert fp8.choose(small).name == "fp8_w8a8"
    assert "fp8_cublas_blockwise: M = 64 < 128" in fp8.describe(small)
    assert fp8.choose(p._replace(cublas_format="w: scales in 1 x 384 blocks")).name == "fp8_w8a8"
    assert fp8.choose(p._replace(dtype=torch.float32)).name == "fp8_w8a8"
    assert "the weights not given" in fp8.describe(fp8.Problem("cuda", torch.bfloat16, 2048, 0))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("M", [8, 13])
@pytest.mark.parametrize("K", [384, 512])
def test_cublas_mlp_glue_matches_the_recipe_in_float64(monkeypatch, gated, M, K):
    """Padding rows to 4, the scales' layouts (K's blocks padded to 4 where they are not), act · up between the GEMMs:
    against transformers' W8A8 semantics."""
    monkeypatch.setattr(fp8_cublas.compat, "scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(fp8_cublas, "quantize_rows", K8.quantize_rows_reference)  # the interpreter misrounds fp8
    g = torch.Generator().manual_seed(M)
    I = 256
    fws = [weight(I, K, g), weight(I, K, g), weight(K, I, g)] if gated else [weight(I, K, g), weight(K, I, g)]
    x = torch.randn(M, K, generator=g, dtype=torch.float32)
    names = ("w_gate", "w_up", "w_down") if gated else ("w1", "w2")
    y = fp8_cublas.mlp(x, [(n, fw, None) for n, fw in zip(names, fws)], "silu", gated)
    assert y.shape == (M, K)
    assert rel_err(y, aten_w8a8(x, fws, gated)) < 1e-5
    b = torch.randn(I, generator=g)
    assert rel_err(fp8_cublas.linear(x, fws[0]), lin64(x, fws[0])) < 1e-5
    assert rel_err(fp8_cublas.linear(x, fws[0], b), lin64(x, fws[0]) + b.double()) < 1e-5


def layer(kind, K, I, g, device="cpu"):
    """[(name, Fp8Weight, bias)] of a linear (I, K), a plain or a gated MLP, every weight with a bias."""
    shapes = {"linear": [(I, K)], "plain": [(I, K), (K, I)], "gated": [(I, K), (I, K), (K, I)]}[kind]
    return [(f"w{i}", weight(n, k, g, device=device), torch.randn(n, generator=g).to(device))
            for i, (n, k) in enumerate(shapes)]


def unplanned(x, weights, kind):
    """The cuBLAS row's function without a plan (the path before plans: x padded by F.pad, scales copied)."""
    return fp8._cublas(x, weights, "silu", kind == "gated")


@pytest.mark.parametrize("triton_quant", [False, True])
@pytest.mark.parametrize("kind", ["linear", "plain", "gated"])
@pytest.mark.parametrize("M", [6, 13])
@pytest.mark.parametrize("K", [384, 512])
def test_the_planned_cublas_row_equals_the_unplanned_bit_for_bit(monkeypatch, triton_quant, kind, M, K):
    """The plan (rows padded and x's scales written column-major by the quantize kernel, the weights' scales laid out
    per signature) gives the unplanned path's bits; quantized by aten's reference, or by the Triton kernel under the
    interpreter on both paths (its fp8 rounding is the interpreter's, the same on both), or on the GPU."""
    monkeypatch.setattr(fp8_cublas.compat, "scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(K8, "INTERPRET", not triton_quant)  # the plan's quantization: aten's (True) or the kernel's
    if not triton_quant:
        monkeypatch.setattr(fp8_cublas, "quantize_rows", K8.quantize_rows_reference)
    g = torch.Generator().manual_seed(M * K)
    weights = layer(kind, K, 256, g, KERNEL_DEVICE)
    x = (torch.randn(2, M, K, generator=g, dtype=torch.float16) * 3).to(KERNEL_DEVICE)
    args = (x, weights, "silu", kind == "gated")
    y = fp8._cublas_plan(args)(x, weights)
    want = unplanned(*args[:2], kind)
    assert y.shape == want.shape == (2, M, weights[-1][1].w.shape[0])
    assert torch.equal(y, want)
    if kind == "gated" and not triton_quant:  # and both are transformers' W8A8 (in float32, without biases)
        x32, nobias = x.float(), [(n, fw, None) for n, fw, _ in weights]
        y32 = fp8._cublas_plan((x32, nobias, "silu", True))(x32, nobias).reshape(-1, K)
        assert rel_err(y32, aten_w8a8(x32.reshape(-1, K), [fw for _, fw, _ in weights], True)) < 1e-5


@pytest.mark.parametrize("kind", ["linear", "gated"])
@pytest.mark.parametrize("K", [384, 512])
def test_a_later_call_of_the_signature_computes_with_its_own_weights(monkeypatch, kind, K):
    """Through the op: the second layer's call reuses the first's plan (same signature) and gives its own result, the
    unplanned path's on its weights, not the first layer's."""
    monkeypatch.setattr(fp8_cublas.compat, "scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(fp8_cublas, "quantize_rows", K8.quantize_rows_reference)
    monkeypatch.setattr(K8, "INTERPRET", True)  # the plan quantizes in aten too, on any device
    monkeypatch.setattr(fp8, "why_not_kernels", lambda device, index: None)
    monkeypatch.setattr(fp8_cublas, "why_not_device", lambda index: None)
    monkeypatch.setattr(fp8, "CUBLAS_FROM_M", 1)
    monkeypatch.setattr(fp8, "_PLANS", {})
    planned = []
    for name in ("linear_plan", "mlp_plan"):
        real = getattr(fp8_cublas, name)
        monkeypatch.setattr(fp8_cublas, name, lambda *a, real=real: planned.append(1) or real(*a))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, K, generator=g, dtype=torch.float16).to(KERNEL_DEVICE)
    op = quant.quant_linear if kind == "linear" else quant.quant_gated_mlp
    tail = ("fp8_e4m3", [128, 128]) if kind == "linear" else ("silu", "fp8_e4m3", [128, 128])
    results = []
    for _ in range(2):
        weights = layer(kind, K, 256, g, KERNEL_DEVICE)  # K 384: scales padded per call; 512: as they are
        assert fp8.choose(fp8.Problem("cuda", x.dtype, 7, 0, None)).name == "fp8_cublas_blockwise"
        y = op(x, *[t for _, fw, b in weights for t in (fw.w, fw.scale, b)], *tail)
        assert torch.equal(y, unplanned(x, weights, kind))
        results.append(y)
    assert planned == [1]  # one plan, two layers
    assert not torch.equal(results[0], results[1])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="cuBLAS")
@pytest.mark.parametrize("M", [512, 1030])
def test_the_op_on_cublas_is_as_accurate_as_the_fused_kernels(M):
    """On an sm90 GPU the gated op takes cuBLAS from 512 rows; its error against float64 (on the dequantized weights)
    is within 1.25x that of the fused W8A8 kernels on the same call."""
    from mlp_fuser import config

    g = torch.Generator().manual_seed(M)
    K, I = 1024, 768
    fws = [weight(I, K, g, device="cuda"), weight(I, K, g, device="cuda"), weight(K, I, g, device="cuda")]
    x = torch.randn(M, K, generator=g).to("cuda", torch.bfloat16)
    args = [t for fw in fws for t in (fw.w, fw.scale, None)]
    weights = [(n, fw, None) for n, fw in zip(("w_gate", "w_up", "w_down"), fws)]
    why = fp8_cublas.why_not_device(x.device.index)
    if why is not None:
        assert quant.choose(x, M, weights) == "fp8_w8a8"
        pytest.skip(f"this GPU: {why}")
    assert quant.choose(x, M, weights) == "fp8_cublas_blockwise"
    y = quant.quant_gated_mlp(x, *args, "silu", "fp8_e4m3", [128, 128])
    with config.patch(force_impl="fp8_w8a8"):
        y_fused = quant.quant_gated_mlp(x, *args, "silu", "fp8_e4m3", [128, 128])
    d = [K8.dequantize(fw, torch.float64) for fw in fws]
    xx = x.double()
    ref = (torch.nn.functional.silu(xx @ d[0].T) * (xx @ d[1].T)) @ d[2].T
    assert rel_err(y, ref) <= 1.25 * rel_err(y_fused, ref)


@pytest.mark.skipif(not CUDA and not INTERPRET, reason="the fused row's Triton kernels need CUDA or the interpreter")
def test_a_call_torch_refuses_runs_on_the_next_row_and_drops_the_row(monkeypatch):
    """Where torch's scaled_mm raises (a layout its version does not take), the call's result is the fused row's
    and the row says why it is no longer chosen on that device."""
    def refuse(*args, **kwargs):
        raise ValueError("scale_a must have strides (1, 8)")

    device = "cuda" if CUDA else "cpu"
    if not CUDA:
        monkeypatch.setattr(fp8, "why_not_kernels", lambda device, index: None)
    monkeypatch.setattr(fp8, "CUBLAS_FROM_M", 8)
    monkeypatch.setattr(fp8_cublas.compat, "scaled_mm", refuse)
    index = torch.cuda.current_device() if CUDA else None  # the key x's calls ask (x.device.index)
    monkeypatch.setitem(fp8_cublas._RUNS, index, None)  # the row runs here: the refusal comes from the call
    monkeypatch.setattr(fp8, "_PLANS", {})
    g = torch.Generator().manual_seed(9)
    K, I = 384, 256
    fws = [weight(I, K, g, device=device), weight(I, K, g, device=device), weight(K, I, g, device=device)]
    x = torch.randn(8, K, generator=g).to(device, torch.float16)
    args = [t for fw in fws for t in (fw.w, fw.scale, None)]
    weights = [(n, fw, None) for n, fw in zip(("w_gate", "w_up", "w_down"), fws)]
    assert quant.choose(x, 8, weights) == "fp8_cublas_blockwise"
    y = quant.quant_gated_mlp(x, *args, "silu", "fp8_e4m3", [128, 128])
    assert "refused a call here (ValueError: scale_a must have strides" in quant.describe(x, 8, weights)
    assert quant.choose(x, 8, weights) == "fp8_w8a8"
    with mlp_fuser.config.patch(force_impl="fp8_w8a8"):
        assert torch.equal(y, quant.quant_gated_mlp(x, *args, "silu", "fp8_e4m3", [128, 128]))


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("M,K", [(13, 384), (8, 520)])
def test_the_glue_kernel_is_the_aten_glue(monkeypatch, gated, M, K):
    """``act_quant_plan``'s one launch (act · up, then h quantized per token and 128 columns) against the aten steps
    it replaces: act, the product in place, ``quantize_rows``. Under the interpreter (fp16) the same bits, each
    rounding included; on the GPU (bf16), where Triton's exp and aten's differ by an ulp, an fp8 step at most and the
    same error against float64 as aten's."""
    monkeypatch.setattr(K8, "INTERPRET", False)  # the kernel itself, also under the interpreter
    dtype = torch.bfloat16 if CUDA else torch.float16
    g_ = torch.Generator().manual_seed(M * K + gated)
    g, u = ((torch.randn(M, K, generator=g_) * 3).to(KERNEL_DEVICE, dtype) for _ in range(2))
    q, s = K8.act_quant_plan(M, K, "silu", gated)(g, u)
    h = torch.nn.functional.silu(g)
    if gated:
        h.mul_(u)
    q2, s2 = K8.quantize_rows(h)
    if not CUDA:
        assert torch.equal(s, s2) and torch.equal(q.float(), q2.float())
        return
    deq = (q.double() * s.double().repeat_interleave(128, 1)[:, :K]).cpu()
    deq2 = (q2.double() * s2.double().repeat_interleave(128, 1)[:, :K]).cpu()
    h64 = torch.nn.functional.silu(g.double()) * (u.double() if gated else 1)
    assert (deq - deq2).abs().max() <= 40 * s2.double().max().cpu()  # an fp8 step (32 units of s at 448), an ulp of s
    assert rel_err(deq, h64.cpu()) <= 1.02 * rel_err(deq2, h64.cpu())
