"""FP8 weights: the kernels (under the interpreter on the CPU, bf16 on CUDA), the quant_* ops and patch on models
whose projections are transformers' FP8Linear."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import mlp_fuser
from mlp_fuser import compat, config
from mlp_fuser.dispatch import fp8
from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels.common import INTERPRET
from mlp_fuser.ops import quant
from mlp_fuser.patch.fp8 import fp8_linear_block
from mlp_fuser.patch.modules import fused_mlp
from mlp_fuser.reference import rel_err

CUDA = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if CUDA else ("cpu" if INTERPRET else None)
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
FMTS = ("block", "channel", "tensor")


def quantized(N: int, K: int, fmt: str, block=(32, 64), device="cpu", g=None):
    """A random float8 weight (N, K) with random positive scales in ``fmt``; (w, scale, block or None)."""
    w = (torch.randn(N, K, generator=g) * 2).to(K8.FP8).to(device)
    if fmt == "block":
        s = torch.rand(K8.cdiv(N, block[0]), K8.cdiv(K, block[1]), generator=g) * 0.02 + 0.005
        return w, s.to(device), block
    if fmt == "channel":
        return w, (torch.rand(N, generator=g) * 0.02 + 0.005).to(device), None
    return w, torch.tensor(0.011, device=device), None


def dequant64(w, s, block):
    return K8.dequantize(K8.fp8_weight(w, s, block), torch.float64)


def test_w8a8_needs_k_blocks_of_32(monkeypatch):
    """Scale blocks 16 wide along K (a float8 dot takes K 32 at least on the GPU): the W8A8 kernels raise, naming the
    blocks; the table passes its W8A8 row over for the W8A16 one and says why. 32 wide: W8A8 runs."""
    g = torch.Generator().manual_seed(4)
    monkeypatch.setattr(fp8, "why_not_kernels", lambda device, index: None)  # as on an sm90 GPU
    for block, row in (((16, 16), "fp8_w8a16"), ((16, 32), "fp8_w8a8")):
        fw = K8.fp8_weight(*quantized(64, 96, "block", block=block, g=g))
        down = K8.fp8_weight(*quantized(96, 64, "block", g=g))
        weights = [("w_gate", fw, None), ("w_up", fw, None), ("w_down", down, None)]
        p = fp8.Problem("cuda", torch.bfloat16, 8, 0, "not read here", fp8.a8_format(weights))
        assert fp8.choose(p).name == row, block
    assert "fp8_w8a8: w_gate: scale blocks 16 wide along K" in fp8.describe(p._replace(a8_format=fp8.a8_format(
        [("w_gate", K8.fp8_weight(*quantized(64, 96, "block", block=(16, 16), g=g)), None)])))
    with pytest.raises(ValueError, match="blocks 16 wide along K"):
        K8.linear_plan(torch.randn(8, 96), K8.fp8_weight(*quantized(64, 96, "block", block=(16, 16), g=g)), a8=True)


# ---- the kernels ---------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("a8", [False, True])
@pytest.mark.parametrize("M,N,K", [(3, 96, 200), (20, 130, 256)])
def test_fp8_linear_matches_float64(fmt, gated, a8, M, N, K):
    g = torch.Generator().manual_seed(M * N + K)
    dt = torch.bfloat16 if CUDA else torch.float16
    x = torch.randn(M, K, generator=g).to(KERNEL_DEVICE, dt)
    w = K8.fp8_weight(*quantized(N, K, fmt, device=KERNEL_DEVICE, g=g))
    u = K8.fp8_weight(*quantized(N, K, fmt, device=KERNEL_DEVICE, g=g)) if gated else None
    bias = None if gated else torch.randn(N, generator=g).to(KERNEL_DEVICE, dt)
    y = K8.fp8_linear(x, w, u, bias=bias, activation="silu" if gated else "gelu", a8=a8)
    if a8:  # the kernels multiply the quantized activations: the reference does too
        q, s = K8.quantize_rows_reference(x)
        xx = q.double() * s.double().repeat_interleave(K8.A8_BLOCK, 1)[:, :K]
    else:
        xx = x.double()
    ref = xx @ K8.dequantize(w, torch.float64).T
    if gated:
        ref = F.silu(ref) * (xx @ K8.dequantize(u, torch.float64).T)
    else:
        ref = F.gelu(ref + bias.double())
    assert y.dtype == dt and y.shape == (M, N)
    assert rel_err(y, ref) < (8e-3 if dt == torch.bfloat16 else 1e-3)


@needs_kernels
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("M,N,K", [(40, 130, 256), (17, 96, 208)])
def test_fp8_linear_tma_kernel_matches_float64(fmt, gated, M, N, K):
    """The large-M kernel (TMA boxes, zero past M, N and K): tiles cut by every edge, against float64."""
    g = torch.Generator().manual_seed(M + N * K)
    dt = torch.bfloat16 if CUDA else torch.float16
    x = torch.randn(M, K, generator=g).to(KERNEL_DEVICE, dt)
    w = K8.fp8_weight(*quantized(N, K, fmt, device=KERNEL_DEVICE, g=g))
    u = K8.fp8_weight(*quantized(N, K, fmt, device=KERNEL_DEVICE, g=g)) if gated else None
    bias = None if gated else torch.randn(N, generator=g).to(KERNEL_DEVICE, dt)
    cfg = K8.Config(16, 32, 32, 1, 4, 1, tma=True) if INTERPRET else K8.Config(64, 64, 64, 1, 4, 3, tma=True)
    assert K8.tma_why_not(K8.quantize_rows(x)[0], w, u, True, cfg) is None
    y = K8.fp8_linear(x, w, u, bias=bias, activation="silu" if gated else "gelu", a8=True, config=cfg)
    q, s = K8.quantize_rows_reference(x)
    xx = q.double() * s.double().repeat_interleave(K8.A8_BLOCK, 1)[:, :K]
    ref = xx @ K8.dequantize(w, torch.float64).T
    ref = F.silu(ref) * (xx @ K8.dequantize(u, torch.float64).T) if gated else F.gelu(ref + bias.double())
    assert y.dtype == dt and y.shape == (M, N)
    assert rel_err(y, ref) < (8e-3 if dt == torch.bfloat16 else 1e-3)


def test_fp8_tma_kernel_says_why_it_cannot_run():
    w = K8.fp8_weight(*quantized(64, 200, "block", g=torch.Generator().manual_seed(0)))
    cfg = K8.Config(16, 32, 32, 1, 4, 1, tma=True)
    xq = torch.zeros(4, 200, dtype=K8.FP8)
    assert "16-byte" in K8.tma_why_not(xq, w, None, True, cfg)  # rows of 200 bytes
    assert "W8A16" in K8.tma_why_not(xq, w, None, False, cfg)



@needs_kernels
@pytest.mark.parametrize("gated", [False, True])
def test_fp8_tma_plan_reads_each_calls_weights_and_falls_back_off_alignment(gated):
    """The large-M kernel's plan, built on one layer's call, given another layer's weights of that signature, gives
    what a plan of its own gives (each weight's descriptor its own) and the float64 value; a weight whose address
    lost its 16-byte alignment runs the split-K kernel instead."""
    from mlp_fuser.kernels import common

    M, N, K = 40, 96, 256
    dt = torch.bfloat16 if CUDA else torch.float16
    cfg = K8.Config(16, 32, 32, 1, 4, 1, tma=True) if INTERPRET else K8.Config(64, 64, 64, 1, 4, 3, tma=True)
    act = "silu" if gated else "gelu"

    def layer(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(M, K, generator=g).to(KERNEL_DEVICE, dt)
        w = K8.fp8_weight(*quantized(N, K, "block", device=KERNEL_DEVICE, g=g))
        u = K8.fp8_weight(*quantized(N, K, "block", device=KERNEL_DEVICE, g=g)) if gated else None
        return x, w, u, None if gated else torch.randn(N, generator=g).to(KERNEL_DEVICE, dt)

    def kernels(fn, *args):
        common.Launcher.recording.launches = []
        try:
            return fn(*args), [launcher.kernel for launcher, _, _ in common.Launcher.recording.launches]
        finally:
            del common.Launcher.recording.launches

    a, b = layer(1), layer(2)
    plan = K8.linear_plan(*a, act, True, cfg)
    plan(*a)
    y, ran = kernels(plan, *b)
    assert K8._fp8_gemm_tma_kernel in ran and K8._fp8_linear_kernel not in ran
    assert torch.equal(y, K8.linear_plan(*b, act, True, cfg)(*b))
    x, w, u, bias = b
    q, s = K8.quantize_rows_reference(x)
    xx = q.double() * s.double().repeat_interleave(K8.A8_BLOCK, 1)[:, :K]
    ref = xx @ K8.dequantize(w, torch.float64).T
    ref = F.silu(ref) * (xx @ K8.dequantize(u, torch.float64).T) if gated else F.gelu(ref + bias.double())
    assert rel_err(y, ref) < (8e-3 if dt == torch.bfloat16 else 1e-3)

    def off(fw):  # the same weight one byte past an aligned address: contiguous, no TMA operand
        buf = torch.empty(N * K + 1, dtype=K8.FP8, device=KERNEL_DEVICE)[1:].view(N, K)
        return fw._replace(w=buf.copy_(fw.w))
    moved = (x, off(w), off(u) if gated else None, bias)
    y, ran = kernels(plan, *moved)
    assert K8._fp8_linear_kernel in ran and K8._fp8_gemm_tma_kernel not in ran
    assert torch.equal(y, K8.fp8_linear(*moved[:3], bias=bias, activation=act, a8=True,
                                        config=cfg._replace(tma=False)))


@needs_kernels
def test_fp8_linear_given_a_tma_config_for_w8a16_runs_the_split_k_kernel():
    g = torch.Generator().manual_seed(3)
    w = K8.fp8_weight(*quantized(64, 256, "block", device=KERNEL_DEVICE, g=g))
    x = torch.randn(5, 256, generator=g).to(KERNEL_DEVICE, torch.float32)
    cfg = K8.Config(16, 32, 32, 1, 4, 1, tma=True)
    y = K8.fp8_linear(x, w, a8=False, config=cfg)
    assert torch.equal(y, K8.fp8_linear(x, w, a8=False, config=cfg._replace(tma=False)))
    assert rel_err(y, x.double() @ K8.dequantize(w, torch.float64).T) < 1e-5


@needs_kernels
def test_fp8_linear_reads_a_transposed_weight_and_splits_k():
    """The backward reads W transposed where it lies; split-K sums partials: both against float64."""
    g = torch.Generator().manual_seed(1)
    w, s, block = quantized(96, 160, "block", device=KERNEL_DEVICE, g=g)
    fw = K8.fp8_weight(w, s, block)
    wt = K8.Fp8Weight(fw.w.t(), fw.scale.t(), fw.block_k, fw.block_n)
    dy = torch.randn(5, 96, generator=g).to(KERNEL_DEVICE, torch.float32)
    for split in (1, 3):
        cfg = K8.Config(16, 32, 32, split, 4, 1)
        out = K8.fp8_linear(dy, wt, config=cfg)
        assert rel_err(out, dy.double() @ K8.dequantize(fw, torch.float64)) < 1e-5


def test_quantize_rows_reference_is_transformers_scheme():
    """One scale per token and 128 columns: amax / 448, the quantized block's largest magnitude 448."""
    x = torch.randn(4, 300, dtype=torch.float64)
    q, s = K8.quantize_rows_reference(x)
    assert q.dtype == K8.FP8 and s.shape == (4, 3)
    blocks = F.pad(x, (0, 84)).view(4, 3, 128)
    assert torch.allclose(s.double(), blocks.abs().amax(-1) / 448, rtol=1e-6)
    assert (q.float().abs().view(4, -1)[:, :256].view(4, 2, 128).amax(-1) == 448).all()
    deq = q.double() * s.double().repeat_interleave(128, 1)[:, :300]
    assert rel_err(deq, x) < 0.05  # e4m3 keeps 3 mantissa bits


def test_quantize_blocks_makes_checkpoint_weights():
    """One fp32 scale per 128 x 128 block (amax / 448; ragged edges too, and stacked experts): each block's largest
    magnitude is 448, and dequantizing gives the weight back within e4m3's rounding."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 300, 200, generator=g, dtype=torch.float64) * torch.rand(3, 300, 1, generator=g)
    q, s = K8.quantize_blocks(w)
    assert q.dtype == K8.FP8 and q.shape == w.shape and s.dtype == torch.float32 and s.shape == (3, 3, 2)
    for e in range(3):
        blocks = F.pad(w[e], (0, 56, 0, 84)).view(3, 128, 2, 128)
        assert torch.allclose(s[e].double(), blocks.abs().amax(dim=(1, 3)) / 448, rtol=1e-6)
        deq = K8.dequantize(K8.fp8_weight(q[e], s[e], (128, 128)), torch.float64)
        assert F.pad(q[e].float().abs(), (0, 56, 0, 84)).view(3, 128, 2, 128).amax(dim=(1, 3)).eq(448).all()
        assert rel_err(deq, w[e]) < 0.04  # e4m3 keeps 3 mantissa bits


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the quantization kernel runs on CUDA (the interpreter misrounds fp8 casts)")
@pytest.mark.parametrize("M", [5, 37])
def test_quantize_rows_kernel_matches_reference(M):
    x = torch.randn(M, 520, device="cuda", dtype=torch.bfloat16)
    q, s = K8.quantize_rows(x)
    q2, s2 = K8.quantize_rows_reference(x)
    assert torch.equal(s, s2) and torch.equal(q.float(), q2.float())


# ---- formats and their errors ------------------------------------------------------------------------------


def test_fp8_weight_formats_and_errors():
    w = torch.randn(300, 200).to(K8.FP8)
    assert K8.fp8_weight(w, torch.ones(3, 2), (128, 128))[2:] == (128, 128)
    assert K8.fp8_weight(w, torch.ones(300))[2:] == (1, 200)
    assert K8.fp8_weight(w, torch.tensor(2.0)).scale.shape == (300, 1)
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None:  # UE8M0 scales are powers of two, exact in fp32
        fw = K8.fp8_weight(w, torch.full((3, 2), 0.25).to(e8m0), (128, 128))
        assert fw.scale.dtype == torch.float32 and (fw.scale == 0.25).all()
    with pytest.raises(ValueError, match=r"must be \(3, 2\), got \(2, 2\)"):
        K8.fp8_weight(w, torch.ones(2, 2), (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        K8.fp8_weight(w.to(torch.float8_e5m2), torch.ones(300))
    with pytest.raises(ValueError, match="fit no format"):
        K8.fp8_weight(w, torch.ones(7))
    with pytest.raises(ValueError, match="unknown weight_format 'int4'"):
        quant.quant_linear(torch.randn(2, 200), w, torch.ones(300), None, "int4")
    with pytest.raises(ValueError, match=r"must be \(2, 3\), got \(1, 1, 1\) \(argument 'w_down'\)"):
        wd = torch.randn(200, 300).to(K8.FP8)
        quant.quant_gated_mlp(torch.randn(2, 200), w, torch.ones(3, 2), None, w, torch.ones(3, 2), None, wd,
                              torch.ones(1, 1, 1), None, "silu", block=(128, 128))
    with pytest.raises(ValueError, match="in-features 200 != x's last dimension 100"):
        quant.quant_linear(torch.randn(2, 100), w, torch.ones(300), None)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        quant.quant_linear(torch.randn(2, 200, dtype=torch.float64), w, torch.ones(300), None)


# ---- the ops: values, gradients, torch.compile ---------------------------------------------------------------


def _gated_args(K, I, O, fmt, g, biases=False):
    out = []
    for n, k in ((I, K), (I, K), (O, I)):
        w, s, block = quantized(n, k, fmt, g=g)
        out += [w, s, torch.randn(n, generator=g, requires_grad=True) if biases else None]
    return out, block


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("biases", [False, True])
def test_quant_gated_mlp_and_its_input_gradient(fmt, biases):
    g = torch.Generator().manual_seed(7)
    args, block = _gated_args(64, 96, 80, fmt, g, biases)
    x = torch.randn(2, 3, 64, generator=g, requires_grad=True)
    y = quant.quant_gated_mlp(x, *args, "silu", block=block)
    xd = x.detach().double().requires_grad_()
    wg, wu, wd = (dequant64(args[i], args[i + 1], block) for i in (0, 3, 6))
    bd = [args[i].detach().double().requires_grad_() if biases else None for i in (2, 5, 8)]
    ref = F.linear(F.silu(F.linear(xd, wg, bd[0])) * F.linear(xd, wu, bd[1]), wd, bd[2])
    assert rel_err(y, ref) < 1e-5
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    ref.backward(dy.double())
    assert rel_err(x.grad, xd.grad) < 1e-5
    for i, b in zip((2, 5, 8), bd):
        if biases:
            assert rel_err(args[i].grad, b.grad) < 1e-5
    assert args[0].grad is None and args[1].grad is None  # frozen weights


def test_quant_mlp_quant_linear_and_compile():
    g = torch.Generator().manual_seed(3)
    w1, s1, block = quantized(96, 64, "block", g=g)
    w2, s2, _ = quantized(48, 96, "block", g=g)
    b1 = torch.randn(96, generator=g)
    x = torch.randn(5, 64, generator=g, requires_grad=True)
    y = quant.quant_mlp(x, w1, s1, b1, w2, s2, None, "gelu_tanh", block=block)
    ref = F.linear(F.gelu(F.linear(x.double(), dequant64(w1, s1, block), b1.double()), approximate="tanh"),
                   dequant64(w2, s2, block))
    assert rel_err(y, ref) < 1e-5
    (y * torch.arange(48.0)).sum().backward()
    xd = x.detach().double().requires_grad_()
    r = F.linear(F.gelu(F.linear(xd, dequant64(w1, s1, block), b1.double()), approximate="tanh"),
                 dequant64(w2, s2, block))
    (r * torch.arange(48.0, dtype=torch.float64)).sum().backward()
    assert rel_err(x.grad, xd.grad) < 1e-5
    lin = quant.quant_linear(x.detach(), w1, s1, b1, block=block)
    assert rel_err(lin, F.linear(x.detach().double(), dequant64(w1, s1, block), b1.double())) < 1e-6
    compiled = torch.compile(lambda t: quant.quant_mlp(t, w1, s1, b1, w2, s2, None, "gelu_tanh", block=block),
                             fullgraph=True, backend="eager")
    assert rel_err(compiled(x.detach()), ref) < 1e-5


@needs_kernels
@pytest.mark.parametrize("kind", ["linear", "mlp", "gated"])
def test_quant_ops_backward_compiles_to_ops(kind, monkeypatch):
    """A compiled backward (AOTAutograd traces it on fake tensors: LoRA on an FP8 base under torch.compile) holds the
    weights' products as ops (``quant_linear_t``, ``quant_linear``), not the kernels' launches, which read data
    pointers that fake tensors lack; its x gradient equals float64's."""
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setattr(config, "triton_on_cpu", True)  # the kernels' path on the CPU too (the interpreter)
    monkeypatch.setattr(config, "fp8_w8a8", False)  # activations unquantized: float64's gradient to fp16's rounding
    dev, dt = KERNEL_DEVICE, torch.float16 if KERNEL_DEVICE == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(11)
    (wg, sg, block), (wu, su, _), (wd, sd, _) = (quantized(n, k, "block", g=g, device=dev)
                                                  for n, k in ((64, 64), (64, 64), (64, 64)))
    fns = {"linear": (lambda t: quant.quant_linear(t, wg, sg, None, block=block),
                      lambda t: F.linear(t, dequant64(wg, sg, block))),
           "mlp": (lambda t: quant.quant_mlp(t, wg, sg, None, wd, sd, None, "silu", block=block),
                   lambda t: F.linear(F.silu(F.linear(t, dequant64(wg, sg, block))), dequant64(wd, sd, block))),
           "gated": (lambda t: quant.quant_gated_mlp(t, wg, sg, None, wu, su, None, wd, sd, None, "silu", block=block),
                     lambda t: F.linear(F.silu(F.linear(t, dequant64(wg, sg, block)))
                                        * F.linear(t, dequant64(wu, su, block)), dequant64(wd, sd, block)))}
    fn, ref_fn = fns[kind]
    backward_graphs = []

    def keep_backward(gm, example_inputs):
        backward_graphs.append(gm)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=lambda gm, ex: gm,
                                                                      bw_compiler=keep_backward))
    x = (torch.randn(5, 64, generator=g) * 0.5).to(dev, dt).requires_grad_()
    dy = torch.randn(5, 64, generator=g).to(dev, dt)
    compiled(x).backward(dy)
    xd = x.detach().double().requires_grad_()
    ref_fn(xd).backward(dy.double())
    assert rel_err(x.grad, xd.grad) < 2 * torch.finfo(dt).eps  # two roundings of x's dtype
    called = {str(n.target) for n in backward_graphs[0].graph.nodes if n.op == "call_function"}
    assert "mlp_fuser.quant_linear_t.default" in called, called
    assert not any(t.startswith(("aten.mm", "aten.bmm", "aten.addmm")) for t in called), called


@pytest.mark.parametrize("kind", ["linear", "mlp", "gated"])
def test_quant_ops_check_every_call_after_a_good_one(kind):
    """A signature that passed the checks skips them on later calls (ops/quant._SEEN), yet a later call with x of
    that signature and a bad scale, bias or weight still raises the error naming it."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 64, generator=g)
    shapes = {"linear": [(96, 64)], "mlp": [(96, 64), (48, 96)], "gated": [(96, 64), (96, 64), (48, 96)]}[kind]
    names = {"linear": ["w"], "mlp": ["w1", "w2"], "gated": ["w_gate", "w_up", "w_down"]}[kind]
    good = []
    for n, k in shapes:
        w, sc, _ = quantized(n, k, "block", block=(32, 32), g=g)
        good += [w, sc, torch.randn(n, generator=g)]
    if kind == "gated":
        good[2] = good[5] = None  # gate and up without biases: the kernels' fused path

    def op(args):
        if kind == "linear":
            return quant.quant_linear(x, *args, "fp8_e4m3", [32, 32])
        if kind == "mlp":
            return quant.quant_mlp(x, *args, "gelu", "fp8_e4m3", [32, 32])
        return quant.quant_gated_mlp(x, *args, "silu", "fp8_e4m3", [32, 32])

    y = op(good)
    assert torch.equal(op(good), y)  # the second call of the signature: the same value
    last = 3 * (len(shapes) - 1)
    n, k = shapes[-1]
    sn, sk = K8.cdiv(n, 32), K8.cdiv(k, 32)
    bad_scale = good[:last + 1] + [torch.ones(sn, sk + 1)] + good[last + 2:]
    with pytest.raises(ValueError, match=rf"must be \({sn}, {sk}\), got \({sn}, {sk + 1}\) "
                                         rf"\(argument '{names[-1]}'\)"):
        op(bad_scale)
    bad_bias = good[:last + 2] + [torch.randn(n + 1)]
    with pytest.raises(ValueError, match=f"the bias of {names[-1]} must be \\({n},\\)"):
        op(bad_bias)
    bad_weight = good[:last] + [good[last].to(torch.float8_e5m2)] + good[last + 1:]
    with pytest.raises(ValueError, match=rf"float8_e4m3fn.*\(argument '{names[-1]}'\)"):
        op(bad_weight)
    assert torch.equal(op(good), y)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dt", [torch.float16, torch.float32])
@pytest.mark.parametrize("kernels", [True, False])
def test_quant_linear_later_calls_read_their_own_scales(fmt, dt, kernels, monkeypatch):
    """Calls of a checked signature build their weights from what the first call found (scales as given, or viewed
    per channel / per tensor): another layer's call equals the unplanned value on that layer's weights, from the
    kernels (fp8_linear) and from the aten row (the weight dequantized, then F.linear)."""
    if kernels and KERNEL_DEVICE is None:
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    device = KERNEL_DEVICE if kernels else "cpu"
    if CUDA and kernels:
        dt = torch.bfloat16 if dt == torch.float16 else dt
    elif kernels:
        monkeypatch.setattr(fp8, "why_not_kernels", lambda device, index: None)
    monkeypatch.setattr(fp8, "_PLANS", {})
    M, N, K = 5, 96, 256

    def layer(seed):
        g = torch.Generator().manual_seed(seed)
        w, sc, block = quantized(N, K, fmt, device=device, g=g)
        return (torch.randn(M, K, generator=g).to(device, dt), w, sc, torch.randn(N, generator=g).to(device, dt)), block

    (x1, *one), block = layer(1)
    (x2, *two), _ = layer(2)
    with mlp_fuser.config.patch(force_impl=None if kernels else "aten_dequantize"):
        quant.quant_linear(x1, *one, "fp8_e4m3", block)
        y = quant.quant_linear(x2, *two, "fp8_e4m3", block)
    w, sc, b = two
    fw = K8.fp8_weight(w, sc, block)
    if kernels:
        assert torch.equal(y, K8.fp8_linear(x2, fw, bias=b, a8=mlp_fuser.config.fp8_w8a8))
    else:
        assert torch.equal(y, F.linear(x2, K8.dequantize(fw, dt), b))
    assert rel_err(y, F.linear(x2.double(), dequant64(w, sc, block), b.double())) < 0.1


def test_quant_ops_pass_opcheck():
    g = torch.Generator().manual_seed(5)
    args, block = _gated_args(64, 96, 80, "block", g)
    x = torch.randn(4, 64, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.mlp_fuser.quant_gated_mlp.default,
                          (x, *args, "silu", "fp8_e4m3", list(block)),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


# ---- patch on FP8Linear models ------------------------------------------------------------------------------


def _fp8_llama(fmt_block=(128, 128), weight_dtype=K8.FP8, layers=2, hidden=256, kv_heads=2, attention_bias=False):
    """A tiny LLaMA of ``layers`` layers whose every Linear but lm_head is transformers' FP8Linear, beside a twin
    holding the same weights dequantized in plain Linears (what the FP8 model computes)."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.finegrained_fp8 import FP8Linear

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=384, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=100,
                                   attention_bias=attention_bias)
    model = transformers.LlamaForCausalLM(cfg).eval()
    twin = copy.deepcopy(model)
    for (_, mod), (_, tmod) in zip(list(model.named_modules()), list(twin.named_modules())):
        for name, c in list(mod.named_children()):
            if type(c) is torch.nn.Linear and name != "lm_head":
                N, K = c.weight.shape
                bn, bk = fmt_block
                wp = F.pad(c.weight.data, (0, (-K) % bk, 0, (-N) % bn))
                blocks = wp.view(wp.shape[0] // bn, bn, wp.shape[1] // bk, bk)
                s = blocks.abs().amax(dim=(1, 3)) / 448
                q = (blocks / s[:, None, :, None]).to(K8.FP8).view_as(wp)[:N, :K].contiguous()
                f = FP8Linear(K, N, block_size=fmt_block, has_bias=c.bias is not None)
                f.weight.data, f.weight_scale_inv.data = q.to(weight_dtype), s
                if c.bias is not None:
                    f.bias.data = c.bias.data.clone()
                setattr(mod, name, f)
                getattr(tmod, name).weight.data = dequant64(q, s, fmt_block).float()
    return model, twin


def test_patch_runs_an_fp8_llama_as_its_dequantized_twin(monkeypatch):
    from mlp_fuser.patch import fp8 as patch_fp8

    calls = []
    counted = patch_fp8._COMPUTE["gated_mlp"]
    monkeypatch.setitem(patch_fp8._COMPUTE, "gated_mlp", lambda *a: calls.append(1) or counted(*a))
    model, twin = _fp8_llama()
    mlp_fuser.patch(model)
    mlp = model.model.layers[0].mlp
    assert fused_mlp(mlp)
    assert fp8_linear_block(model.model.layers[0].self_attn.q_proj) == (128, 128)
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        out, ref = model(ids).logits, twin(ids).logits
    assert len(calls) == 2  # one fused op per layer, called right there (no gradient needed)
    assert rel_err(out, ref) < 1e-5
    out = model(ids).logits  # with gradients on: through the registered op and its autograd
    assert len(calls) == 2 and rel_err(out, ref) < 1e-5 and out.requires_grad
    mlp_fuser.unpatch(model)
    assert "forward" not in mlp.__dict__ and not fused_mlp(mlp)


@pytest.mark.parametrize("static", [False, True])
def test_transformers_fp8linear_runs_its_own_forward_on_the_aten_stand_in(static):
    """transformers' FP8Linear (128 x 128 blocks cut by N and K, a bias; dynamic or static activation scale) inside
    ``transformers_fp8_in_aten`` computes its semantics (float64 here): x quantized per token and 128 columns, or by
    its static scale, times the dequantized weight; the kernel transformers held before is back after the block."""
    pytest.importorskip("transformers")
    from transformers.integrations import finegrained_fp8 as hf

    from mlp_fuser.patch.hf_fp8 import transformers_fp8_in_aten

    g = torch.Generator().manual_seed(3)
    N, K = 200, 320
    q, s = K8.quantize_blocks(torch.randn(N, K, generator=g), (128, 128))
    f = hf.FP8Linear(K, N, block_size=(128, 128), activation_scheme="static" if static else "dynamic", has_bias=True)
    f.weight.data, f.weight_scale_inv.data = q, s
    f.bias.data = torch.randn(N, generator=g)
    if static:
        f.activation_scale.data = torch.tensor(0.009)
    x = torch.randn(2, 5, K, generator=g)
    before = compat.hf_fp8_kernel(hf)
    with transformers_fp8_in_aten():
        y = f(x)
    assert compat.hf_fp8_kernel(hf) is before
    x2 = x.reshape(-1, K)
    if static:
        xx = (x2 / 0.009).clamp(-448, 448).to(K8.FP8).double() * 0.009
    else:
        xq, xs = K8.quantize_rows_reference(x2)
        xx = xq.double() * xs.double().repeat_interleave(128, 1)[:, :K]
    ref = xx @ dequant64(q, s, (128, 128)).T + f.bias.double()
    assert y.shape == (2, 5, N) and rel_err(y.reshape(-1, N), ref) < 1e-6


@needs_kernels
def test_fused_fp8_llama_is_as_accurate_as_transformers_own_fp8_forward(monkeypatch):
    """The FP8 issue's accuracy bar: patched (every FP8Linear through our kernels: the interpreter on the CPU), the
    model's logits err against float64 (the dequantized weights) by at most 1.25x what transformers' own FP8 forward
    errs (its code on the aten stand-in for its Hub kernel)."""
    from mlp_fuser.patch.hf_fp8 import transformers_fp8_in_aten

    monkeypatch.setattr(config, "triton_on_cpu", True)
    model, twin = _fp8_llama()
    model, twin = model.to(KERNEL_DEVICE), twin.to(KERNEL_DEVICE, torch.float64)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(5)).to(KERNEL_DEVICE)
    with torch.no_grad():
        ref = twin(ids).logits
        with transformers_fp8_in_aten():
            theirs = model(ids).logits
        mlp_fuser.patch(model)
        ours = model(ids).logits
    mlp_fuser.unpatch(model)
    e_ours, e_theirs = rel_err(ours, ref), rel_err(theirs, ref)
    assert 0 < e_ours <= 1.25 * e_theirs, f"fused {e_ours:.2e} against transformers' {e_theirs:.2e}"


@needs_kernels
def test_patched_fp8_model_trains_under_the_backend(monkeypatch):
    """An FP8 base with trainable embeddings and norms (LoRA's setting: the float8 weights frozen), patched, then
    compiled by the backend with gradients on: the compiled forward and backward (AOTAutograd traces the quant ops'
    backward on fake tensors) give the loss and every gradient of the eager patched model."""
    monkeypatch.setattr(config, "triton_on_cpu", True)  # the kernels' path on the CPU too (the interpreter)
    monkeypatch.setattr(config, "fp8_w8a8", False)  # no activation rounding to flip between two fp32 schedules
    model, _ = _fp8_llama(layers=1)  # every kind of FP8 linear is in one layer; CPU Inductor compiles take seconds each
    model = model.to(KERNEL_DEVICE)
    for n, p in model.named_parameters():
        p.requires_grad_(p.dtype.is_floating_point and p.element_size() > 1 and "scale" not in n)
    mlp_fuser.patch(model)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(8)).to(KERNEL_DEVICE)

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    torch._dynamo.reset()
    try:
        want_loss, want = step(model)
        got_loss, got = step(torch.compile(model, backend=mlp_fuser.backend))
    finally:
        torch._dynamo.reset()
        mlp_fuser.unpatch(model)
    assert set(got) == set(want) and len(want) > 4
    assert rel_err(got_loss, want_loss) < 1e-5
    for n in want:
        assert rel_err(got[n], want[n]) < 1e-4, n


@pytest.mark.parametrize("direct", [True, False])
def test_inductor_code_calls_the_quant_ops_entry(direct, monkeypatch):
    """A patched FP8 LLaMA compiled by the backend: Inductor's code calls torch.ops.mlp_fuser._inductor_quant_gated_mlp
    and _inductor_quant_linear (attention's lone FP8 linears), computed right there with no round trip through the
    dispatcher, unless config.inductor_direct is off; the logits are the patched model's eager ones either way."""
    from torch._inductor.utils import run_and_get_code

    model, _ = _fp8_llama()
    mlp_fuser.patch(model)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(6))
    monkeypatch.setattr(config, "inductor_direct", direct)
    torch._dynamo.reset()
    try:
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
            expected = model(ids).logits
            out, (code,) = run_and_get_code(lambda: torch.compile(model, backend=mlp_fuser.backend)(ids).logits)
    finally:
        torch._dynamo.reset()
        mlp_fuser.unpatch(model)
    assert rel_err(out, expected) < 1e-5
    layers = model.config.num_hidden_layers
    for op, n in (("quant_gated_mlp", layers), ("quant_linear", 4 * layers)):
        assert code.count(f"torch.ops.mlp_fuser._inductor_{op}(") == (n if direct else 0), op
        assert code.count(f"torch.ops.mlp_fuser.{op}.default(") == (0 if direct else n), op


def test_patched_fp8_llama_under_static_cache_compile_config():
    """generate with a static cache and CompileConfig(backend=mlp_fuser.backend) on a patched FP8 model: the compiled
    decode steps call the FP8 ops (MLPs and the lone FP8 linears) and give the tokens Inductor alone gives."""
    from _hf_models import count_ops
    from transformers import CompileConfig

    def static_generate(model, ids, backend):
        cc = CompileConfig(backend=backend)
        cc._compile_all_devices = True  # transformers compiles on CUDA only unless told
        return model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static", compile_config=cc)

    model, _ = _fp8_llama()
    model.generation_config.pad_token_id = 0
    mlp_fuser.patch(model)
    ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    expected = static_generate(model, ids, "inductor")
    torch._dynamo.reset()
    ops = frozenset({"mlp_fuser::quant_gated_mlp", "mlp_fuser::quant_linear"})
    calls = []
    got = static_generate(model, ids, mlp_fuser.backend)
    calls.append(count_ops(lambda: static_generate(model, ids, mlp_fuser.backend), ops))
    torch._dynamo.reset()
    mlp_fuser.unpatch(model)
    assert torch.equal(got, expected)
    assert calls[0] >= 6 * 2 * 5  # each of 6 forwards: per layer the MLP and 4 attention projections


def test_patch_leaves_an_unsupported_fp8_format_exactly_as_it_was(caplog):
    model, _ = _fp8_llama(weight_dtype=torch.float8_e5m2)
    before = {n: (type(m), dict(m.__dict__).get("forward")) for n, m in model.named_modules()}
    with caplog.at_level("INFO", logger="mlp_fuser"):
        mlp_fuser.patch(model)
    assert {n: (type(m), dict(m.__dict__).get("forward")) for n, m in model.named_modules()} == before
    assert "float8_e5m2" in caplog.text


def test_explain_reports_fp8_mlps_fused_and_the_lone_fp8_layers_patch_runs():
    model, _ = _fp8_llama()
    ids = torch.randint(0, 100, (1, 5))
    for patched in (False, True):
        if patched:
            mlp_fuser.patch(model)
        report = mlp_fuser.explain(model, ids)
        assert report.error is None and report.graphs == 1 and report.graph_breaks == 0  # FP8 layers traced offline
        assert sorted(s.path for s in report.fused) == ["model.layers.0.mlp", "model.layers.1.mlp"]
        assert {s.pattern for s in report.fused} == {"gated (fp8_e4m3 128x128 blocks)"}
        assert len(report.fp8_linears) == 8 and "self_attn.q_proj" in str(report)
    e5m2, _ = _fp8_llama(weight_dtype=torch.float8_e5m2)
    report = mlp_fuser.explain(e5m2, ids)
    assert not report.fused and len(report.near_misses) == 2
    assert "float8_e5m2" in report.near_misses[0].reason


def test_the_implementation_table_says_why_each_row_cannot_run():
    x = torch.randn(4, 64)
    assert quant.choose(x, 4) == "aten_dequantize"
    text = quant.describe(x, 4)
    assert "fp8_w8a8: x is on cpu" in text and text.endswith("aten_dequantize: runs")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="peak memory of the CUDA kernels")
@pytest.mark.parametrize("M", [1, 64, 512])
def test_no_bf16_copy_of_a_weight_exists_in_hbm(M):
    """The op reads the float8 weights where they lie: its peak above x, weights and y stays far below one weight
    in bf16 (what a dequantizing path would allocate)."""
    g = torch.Generator().manual_seed(0)
    K, I = 4096, 14336
    args, block = [], (128, 128)
    for n, k in ((I, K), (I, K), (K, I)):
        w, s, _ = quantized(n, k, "block", block=block, g=g)
        args += [w.cuda(), s.cuda(), None]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    quant.quant_gated_mlp(x, *args, "silu", block=block)  # compiled and warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = quant.quant_gated_mlp(x, *args, "silu", block=block)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - y.numel() * y.element_size()
    assert extra < I * K * 2 // 2  # h, x and h quantized, split-K partials: well under a bf16 weight's 117 MB


@needs_kernels
@pytest.mark.parametrize("a8", [False, True])
@pytest.mark.parametrize("kind", ["linear", "mlp", "gated"])
def test_quant_ops_plan_once_per_signature_and_read_each_calls_weights(kind, a8, monkeypatch):
    """The kernels' launches are worked out once per call signature (``dispatch/fp8.run``); a later call with
    another layer's weights and x of that signature gets its own result, equal to fp8_linear's unplanned one."""
    if not CUDA:
        monkeypatch.setattr(fp8, "why_not_kernels", lambda device, index: None)
    monkeypatch.setattr(fp8, "_PLANS", {})
    built = []
    real = K8.linear_plan
    monkeypatch.setattr(K8, "linear_plan", lambda *a, **kw: built.append(1) or real(*a, **kw))
    dt = torch.bfloat16 if CUDA else torch.float16
    M, K, I = 6, 256, 192

    def layer(seed):
        g = torch.Generator().manual_seed(seed)
        w = [quantized(*shape, "block", block=(128, 128), device=KERNEL_DEVICE, g=g)[:2]
             for shape in {"linear": [(I, K)], "mlp": [(I, K), (K, I)], "gated": [(I, K), (I, K), (K, I)]}[kind]]
        bias = torch.randn(I, generator=g).to(KERNEL_DEVICE, dt)
        return torch.randn(2, 3, K, generator=g).to(KERNEL_DEVICE, dt), w, bias

    def op(x, w, bias):
        if kind == "linear":
            return quant.quant_linear(x, *w[0], bias, "fp8_e4m3", [128, 128])
        if kind == "mlp":
            return quant.quant_mlp(x, *w[0], bias, *w[1], None, "gelu", "fp8_e4m3", [128, 128])
        return quant.quant_gated_mlp(x, *w[0], None, *w[1], None, *w[2], None, "silu", "fp8_e4m3", [128, 128])

    def unplanned(x, w, bias):
        fw = [K8.fp8_weight(q, s, (128, 128)) for q, s in w]
        x2 = x.reshape(M, K)
        with mlp_fuser.config.patch(fp8_w8a8=a8):
            if kind == "linear":
                y = real(x2, fw[0], bias=bias, a8=a8)(x2, fw[0], None, bias)
            elif kind == "mlp":
                h = real(x2, fw[0], None, bias, "gelu", a8)(x2, fw[0], None, bias)
                y = real(h, fw[1], a8=a8)(h, fw[1], None, None)
            else:
                h = real(x2, fw[0], fw[1], None, "silu", a8)(x2, fw[0], fw[1], None)
                y = real(h, fw[2], a8=a8)(h, fw[2], None, None)
        return y.reshape(2, 3, -1)

    with mlp_fuser.config.patch(fp8_w8a8=a8):
        first, second = layer(1), layer(2)
        y1 = op(*first)
        n = len(built)
        y2 = op(*second)
        assert len(built) == n and n == {"linear": 1, "mlp": 2, "gated": 2}[kind]
    assert torch.equal(y1, unplanned(*first)) and torch.equal(y2, unplanned(*second))
    assert not torch.equal(y1, y2)


def test_fp8_w8a8_setting_picks_the_row(monkeypatch):
    monkeypatch.setattr(fp8, "why_not_kernels", lambda device, index: None)  # as on an sm89+ GPU
    x = torch.randn(1, 64)
    assert quant.choose(x, 1) == "fp8_w8a8"
    with mlp_fuser.config.patch(fp8_w8a8=False):
        assert quant.choose(x, 1) == "fp8_w8a16"
        assert "fp8_w8a8: mlp_fuser.config.fp8_w8a8 is off" in quant.describe(x, 1)


@pytest.mark.parametrize("config_name", ["Float8WeightOnlyConfig"])  # the dynamic-activation config needs sm89+
def test_patch_fuses_mlps_torchao_quantized_to_float8(config_name):
    """torchao's quantize_ makes Float8Tensor weights (float8 data, one scale per row): patch runs them through the
    FP8 op, equal to the same model with those weights dequantized."""
    torchao = pytest.importorskip("torchao.quantization")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=50)
    model = transformers.LlamaForCausalLM(cfg).eval()
    try:
        torchao.quantize_(model.model.layers, getattr(torchao, config_name)(),
                          filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and "mlp" in fqn)
    except Exception as e:  # a torchao build that cannot make this config on the CPU
        pytest.skip(f"torchao {config_name} on this machine: {type(e).__name__}: {e}")
    twin = copy.deepcopy(model)
    for mod in twin.modules():
        w = getattr(mod, "weight", None)
        if hasattr(w, "qdata"):  # the same weights, dequantized, as plain Linears
            mod.weight = torch.nn.Parameter(dequant64(w.qdata, w.scale, tuple(w.block_size)).float())
    mlp_fuser.patch(model)
    assert fused_mlp(model.model.layers[0].mlp)
    ids = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        assert rel_err(model(ids).logits, twin(ids).logits) < 1e-5
    report = mlp_fuser.explain(model, ids)
    assert {s.pattern for s in report.fused} == {"gated (fp8_e4m3 per channel, torchao)"}
