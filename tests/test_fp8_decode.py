"""FP8 linears at decode sizes: W8A8 with x quantized inside the split-K GEMM (one launch, the same bits as
quantize_rows then the GEMM) and split-K counters kept by the plan (zeroed once, left at 0 by every call)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
from conftest import requires_cuda

from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels.common import INTERPRET
from mlp_fuser.reference import rel_err

CUDA = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if CUDA else ("cpu" if INTERPRET else None)
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.bfloat16] if CUDA else [torch.float16, torch.float32]


pytestmark = pytest.mark.usefixtures("exact_fp8_casts")  # conftest: in-kernel float8 casts as the GPU's


def weight(N, K, fmt, g):
    """A random float8 weight (N, K) with random positive scales: 32 x 128 blocks, per channel or per tensor."""
    w = (torch.randn(N, K, generator=g) * 2).to(K8.FP8)
    if fmt == "block":
        s, block = torch.rand(K8.cdiv(N, 32), K8.cdiv(K, 128), generator=g) * 0.02 + 0.005, (32, 128)
    elif fmt == "channel":
        s, block = torch.rand(N, generator=g) * 0.02 + 0.005, None
    else:
        s, block = torch.tensor(0.011), None
    return K8.fp8_weight(w.to(KERNEL_DEVICE), s.to(KERNEL_DEVICE), block)


def config(M, split):
    return K8.Config(max(16, triton.next_power_of_2(M)), 32, 128, split, 4, 1)


@needs_kernels
@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("M,N,K,split", [(1, 96, 256, 2), (5, 130, 200, 2), (16, 64, 384, 1), (64, 40, 256, 2)])
def test_x_quantized_in_the_gemm_gives_quantize_rows_bits(monkeypatch, fmt, gated, M, N, K, split):
    """W8A8, BLOCK_K 128: the GEMM quantizing x itself equals quantize_rows then the GEMM bit for bit (K cut by the
    tile too: 200), and the float64 reference on the quantized activations."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    dt = DTYPES[M % len(DTYPES)]
    x = torch.randn(M, K, generator=g).to(KERNEL_DEVICE, dt) * 3
    w = weight(N, K, fmt, g)
    u = weight(N, K, fmt, g) if gated else None
    bias = None if gated else torch.randn(N, generator=g).to(KERNEL_DEVICE, dt)
    act = "silu" if gated else "gelu"
    quantized = []
    real = K8._quantize_plan
    monkeypatch.setattr(K8, "_quantize_plan", lambda *a: quantized.append(a) or real(*a))
    cfg = config(M, split)
    y = K8.fp8_linear(x, w, u, bias=bias, activation=act, a8=True, config=cfg)
    assert not quantized  # one launch: no quantize_rows
    two = K8.fp8_linear(x, w, u, bias=bias, activation=act, a8=True, config=cfg._replace(quant_x=False))
    assert quantized
    assert torch.equal(y, two)
    q, s = K8.quantize_rows_reference(x)
    xx = q.double() * s.double().repeat_interleave(K8.A8_BLOCK, 1)[:, :K]
    ref = xx @ K8.dequantize(w, torch.float64).T
    ref = F.silu(ref) * (xx @ K8.dequantize(u, torch.float64).T) if gated else F.gelu(ref + bias.double())
    assert rel_err(y, ref) < (8e-3 if dt == torch.bfloat16 else 1e-3)


@needs_kernels
def test_quantize_rows_kernel_gives_the_reference_bits():
    """The Triton quantizer the fused GEMM copies and the aten one the interpreter runs agree bit for bit (so the test
    above, against aten's on the CPU, is against the Triton kernel's on the GPU)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 200, generator=g).to(KERNEL_DEVICE, torch.float16) * 3
    q = torch.empty(5, 200, device=KERNEL_DEVICE, dtype=K8.FP8)
    s = torch.empty(5, 2, device=KERNEL_DEVICE, dtype=torch.float32)
    K8.launch(K8._quantize_rows_kernel, (1, 2), x, q, s, 5, 5, 200, x.stride(0), x.stride(1), 2, 1, BLOCK_M=8,
              BLOCK=128, num_warps=4)
    rq, rs = K8.quantize_rows_reference(x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@needs_kernels
def test_quantize_rows_kernel_pads_rows_and_writes_the_scales_transposed():
    """Rows 5 to 8 quantized as zero rows of x and the scales in a (K/128, 8) buffer (cuBLAS' layout seen
    transposed): the bits of x padded with zeros, quantized by the reference, its scales copied column-major."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 200, generator=g).to(KERNEL_DEVICE, torch.float16) * 3
    q = torch.full((8, 200), 1.0, device=KERNEL_DEVICE).to(K8.FP8)
    s = torch.full((2, 8), -1.0, device=KERNEL_DEVICE)
    K8.launch(K8._quantize_rows_kernel, (1, 2), x, q, s, 5, 8, 200, x.stride(0), x.stride(1), 1, 8, BLOCK_M=8,
              BLOCK=128, num_warps=4)
    rq, rs = K8.quantize_rows_reference(torch.nn.functional.pad(x, (0, 0, 0, 3)))
    assert torch.equal(s.t(), rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@needs_kernels
@pytest.mark.parametrize("a8", [False, True])
def test_split_k_counters_kept_by_the_plan_are_zero_after_each_call(monkeypatch, a8):
    """A plan zeroes its counters once; each call leaves them at 0, so a second call (a CUDA-graph replay's case)
    gives the same output."""
    kept = []
    real = K8._zeroed_once
    monkeypatch.setattr(K8, "_zeroed_once", lambda *a: kept.append(real(*a)) or kept[-1])
    g = torch.Generator().manual_seed(11)
    dt = DTYPES[0]
    x = torch.randn(5, 384, generator=g).to(KERNEL_DEVICE, dt)
    w, u = weight(96, 384, "block", g), weight(96, 384, "block", g)
    plan = K8.linear_plan(x, w, u, None, "silu", a8, K8.Config(16, 32, 128, 3, 4, 1))
    assert len(kept) == 1 and kept[0].numel() == 3  # 96 columns in 32-wide tiles
    y = plan(x, w, u, None)
    assert torch.equal(kept[0], torch.zeros_like(kept[0]))
    assert torch.equal(plan(x, w, u, None), y)
    xx = K8.quantize_rows_reference(x) if a8 else None
    xx = xx[0].double() * xx[1].double().repeat_interleave(K8.A8_BLOCK, 1) if a8 else x.double()
    ref = F.silu(xx @ K8.dequantize(w, torch.float64).T) * (xx @ K8.dequantize(u, torch.float64).T)
    assert rel_err(y, ref) < (8e-3 if dt == torch.bfloat16 else 1e-3)


@requires_cuda
def test_kept_counters_under_cuda_graph_trees(monkeypatch):
    """The plans built in Inductor's graph-tree warm-up (their counters made off its pool): each replay's output is
    the eager one bit for bit."""
    from mlp_fuser.dispatch import fp8
    from mlp_fuser.ops import quant

    monkeypatch.setattr(fp8, "_PLANS", {})
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    (wg, sg), (wu, su) = (K8.quantize_blocks(torch.randn(1024, 512, generator=g).cuda() * 0.05) for _ in range(2))
    wd, sd = K8.quantize_blocks(torch.randn(512, 1024, generator=g).cuda() * 0.05)

    def mlp(x):
        return quant.quant_gated_mlp(x, wg, sg, None, wu, su, None, wd, sd, None, "silu", block=(128, 128))
    compiled = torch.compile(mlp, mode="reduce-overhead", fullgraph=True)
    for _ in range(5):
        x = torch.randn(1, 512, generator=g).cuda().bfloat16()
        y = compiled(x).clone()
        assert torch.equal(y, mlp(x))
