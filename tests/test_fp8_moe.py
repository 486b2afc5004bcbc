"""FP8 routed experts: mlp_fuser::quant_moe_mlp (formats, gates, sentinels, errors, gradients) against float64
references written here, on the weights as transformers' FP8Experts stores them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from _moe_cases import sentinels
from conftest import HAS_CUDA, KERNEL_DEVICE, poisoned_empty, requires_cuda

from mlp_fuser import config
from mlp_fuser.dispatch import fp8_experts
from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels import moe as kmoe
from mlp_fuser.ops import quant_moe
from mlp_fuser.reference import Gate, rel_err

FP8 = torch.float8_e4m3fn
# (format, block): per 32 x 64 block, gate and up quantized apart (I not a multiple of the block), per channel, per
# tensor, per tensor for each half of gate/up (FP8Experts without a block size)
FORMATS = [("block", (32, 64)), ("apart", (32, 64)), ("channel", None), ("tensor", None), ("halves", None)]


def expand(s: torch.Tensor, rows: int, cols: int, bn: int, bk: int) -> torch.Tensor:
    """A scale grid (E, R, C) spread over (E, rows, cols) in bn x bk blocks, float64."""
    return s.double().repeat_interleave(bn, 1)[:, :rows].repeat_interleave(bk, 2)[:, :, :cols]


def quantized_experts(E: int, N: int, K: int, fmt: str, block, g: torch.Generator, gated: bool = False):
    """Random float8 experts (E, N, K), their scales in ``fmt`` and the weights they describe in float64."""
    w = (torch.randn(E, N, K, generator=g) * 2).to(FP8)

    def rand(*shape):
        return torch.rand(*shape, generator=g) * 0.02 + 0.005

    if fmt == "block":
        bn, bk = block
        s = rand(E, -(-N // bn), -(-K // bk))
        full = expand(s, N, K, bn, bk)
    elif fmt == "apart":  # gate rows [0, I) and up rows [I, 2I) each on their own grid
        bn, bk = block
        half = -(-(N // 2) // bn)
        s = rand(E, 2 * half, -(-K // bk))
        full = torch.cat([expand(s[:, :half], N // 2, K, bn, bk), expand(s[:, half:], N // 2, K, bn, bk)], 1)
    elif fmt == "channel":
        s = rand(E, N)
        full = s.double()[:, :, None].expand(E, N, K)
    elif fmt == "tensor":
        s = rand(E)
        full = s.double()[:, None, None].expand(E, N, K)
    else:  # halves
        s = rand(E, 2, 1)
        full = s.double().repeat_interleave(N // 2, 1).expand(E, N, K)
    return w, s, w.double() * full


def reference64(x, ids, wts, wgu, wd, act="silu", limit=None, up_offset=0.0, interleaved=False, gated=True):
    """y in float64, a pair at a time; ids >= E contribute nothing."""
    T, k = ids.shape
    E = wgu.shape[0]
    y = [torch.zeros(wd.shape[1], dtype=torch.float64) for _ in range(T)]
    fn = {"silu": F.silu, "gelu": F.gelu}[act]
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e >= E:
                continue
            gu = wgu[e] @ x[t].double()
            if gated:
                g, u = (gu[0::2], gu[1::2]) if interleaved else gu.chunk(2)
                if limit is not None:
                    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                h = fn(g) * (u + up_offset)
            else:
                h = fn(gu)
            y[t] = y[t] + wts[t, j].double() * (wd[e] @ h)
    return torch.stack(y)


def routing(g, T, k, E):
    ids = torch.randint(0, E, (T, k), generator=g)
    drop = torch.rand(T, k, generator=g) < 0.2
    ids = torch.where(drop, sentinels(g, (T, k), E), ids)
    return ids, torch.rand(T, k, generator=g)


def case(fmt, block, T=7, k=3, E=4, H=96, I=48, gated=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = 2 * I if gated else I
    wgu, sgu, wgu64 = quantized_experts(E, N, H, fmt, block, g, gated)
    dfmt = "block" if fmt == "apart" else "tensor" if fmt == "halves" else fmt
    wd, sd, wd64 = quantized_experts(E, H, I, dfmt, block, g)
    x = torch.randn(T, H, generator=g)
    ids, wts = routing(g, T, k, E)
    return x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64)


@pytest.mark.parametrize("fmt,block", FORMATS)
def test_quant_moe_mlp_matches_float64(fmt, block):
    x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64) = case(fmt, block)
    y = quant_moe.quant_moe_mlp(x, ids, wts, wgu, sgu, wd, sd, "silu", block=block)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel_err(y, reference64(x, ids, wts, wgu64, wd64)) < 1e-5


@pytest.mark.parametrize("interleaved", [False, True])
def test_quant_moe_mlp_clamped_gate_and_plain_experts(interleaved):
    """GPT-OSS's gate (clamped, up + 1) in either layout; plain experts (act(x @ W1ᵀ)); a (T, 1, H) x."""
    x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64) = case("block", (32, 64), seed=1)
    x = x * 3  # so that the clamps bite
    y = quant_moe.quant_moe_mlp(x[:, None], ids[:, None], wts[:, None], wgu, sgu, wd, sd, "silu", block=(32, 64),
                                interleaved=interleaved, limit=0.7, up_offset=1.0)
    ref = reference64(x, ids, wts, wgu64, wd64, limit=0.7, up_offset=1.0, interleaved=interleaved)
    assert rel_err(y[:, 0], ref) < 1e-5
    x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64) = case("channel", None, gated=False, seed=2)
    y = quant_moe.quant_moe_mlp(x, ids, wts, wgu, sgu, wd, sd, "gelu")
    assert rel_err(y, reference64(x, ids, wts, wgu64, wd64, act="gelu", gated=False)) < 1e-5


def test_quant_moe_mlp_ue8m0_scales_and_only_sentinels():
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    x, ids, wts, (wgu, sgu, wd, sd), _ = case("block", (32, 64), seed=3)
    p2 = [torch.exp2(torch.round(torch.log2(s))) for s in (sgu, sd)]  # powers of two: exact as UE8M0
    y = quant_moe.quant_moe_mlp(x, ids, wts, wgu, p2[0].to(e8m0), wd, p2[1].to(e8m0), "silu", block=(32, 64))
    ref = reference64(x, ids, wts, wgu.double() * expand(p2[0], 96, 96, 32, 64), wd.double() * expand(p2[1], 96, 48,
                                                                                                       32, 64))
    assert rel_err(y, ref) < 1e-5
    none = quant_moe.quant_moe_mlp(x, torch.full_like(ids, 4), wts, wgu, sgu, wd, sd, "silu", block=(32, 64))
    assert torch.equal(none, torch.zeros_like(x))


@pytest.mark.parametrize("fmt,block", [FORMATS[0], FORMATS[3]])
def test_quant_moe_mlp_input_gradients(fmt, block):
    """dx and d topk_weights against float64 autograd; the frozen weights get none."""
    x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64) = case(fmt, block, seed=4)
    x.requires_grad_()
    wts.requires_grad_()
    y = quant_moe.quant_moe_mlp(x, ids, wts, wgu, sgu, wd, sd, "silu", block=block)
    x64, w64 = x.detach().double().requires_grad_(), wts.detach().double().requires_grad_()
    ref = reference64(x64, ids, w64, wgu64, wd64)
    dy = torch.randn(y.shape)
    y.backward(dy)
    ref.backward(dy.double())
    assert rel_err(x.grad, x64.grad) < 1e-5
    assert rel_err(wts.grad, w64.grad) < 1e-5


def test_quant_moe_mlp_errors_name_the_argument():
    x, ids, wts, (wgu, sgu, wd, sd), _ = case("block", (32, 64))
    op = quant_moe.quant_moe_mlp
    with pytest.raises(ValueError, match=r"must be \(4, 3, 2\).*\(4, 4, 2\).*got \(4, 2, 2\) \(argument 'w_gate_up'\)"):
        op(x, ids, wts, wgu, sgu[:, :2], wd, sd, "silu", block=(32, 64))
    with pytest.raises(ValueError, match=r"must be \(4, 3, 1\), got \(4, 2, 1\) \(argument 'w_down'\)"):
        op(x, ids, wts, wgu, sgu, wd, sd[:, :2], "silu", block=(32, 64))
    with pytest.raises(ValueError, match=r"in 64 x 64 blocks must be \(4, 2, 2\)"):
        op(x, ids, wts, wgu, sgu, wd, sd, "silu", block=(64, 64))
    with pytest.raises(ValueError, match="fit no format"):
        op(x, ids, wts, wgu, sgu, wd, sd, "silu")
    with pytest.raises(ValueError, match="unknown weight_format 'int4'"):
        op(x, ids, wts, wgu, sgu, wd, sd, "silu", "int4", block=(32, 64))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        op(x, ids, wts, wgu.to(torch.float8_e5m2), sgu, wd, sd, "silu", block=(32, 64))
    with pytest.raises(ValueError, match="w_gate_up takes 96 input features but x has 95"):
        op(x[:, :95], ids, wts, wgu, sgu, wd, sd, "silu", block=(32, 64))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        op(x.double(), ids, wts, wgu, sgu, wd, sd, "silu", block=(32, 64))
    with pytest.raises(ValueError, match="topk_ids holds -1"):
        op(x, ids - 1 - ids.clamp(max=0), wts, wgu, sgu, wd, sd, "silu", block=(32, 64))


def test_quant_moe_mlp_passes_opcheck_and_compiles():
    x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64) = case("block", (32, 64), seed=5)
    torch.library.opcheck(torch.ops.mlp_fuser.quant_moe_mlp.default,
                          (x.requires_grad_(), ids, wts, wgu, sgu, wd, sd, "silu", "fp8_e4m3", [32, 64]),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    compiled = torch.compile(lambda t: quant_moe.quant_moe_mlp(t, ids, wts, wgu, sgu, wd, sd, "silu", block=(32, 64)),
                             fullgraph=True, backend="eager")
    assert rel_err(compiled(x.detach()), reference64(x.detach(), ids, wts, wgu64, wd64)) < 1e-5


def test_fp8_experts_reads_each_format():
    """The kernels' reading of a format (scale row per weight row) as the tests' independent expansion has it."""
    g = torch.Generator().manual_seed(6)
    for (fmt, block), N in itertools.product(FORMATS, (40, 96)):  # I = 20: one grid and halves apart alike (3, 2, 2)
        w, s, full = quantized_experts(3, N, 70, fmt, block, g)
        fe = K8.fp8_experts(w, s, block, gated=fmt != "block" or N == 96)
        assert torch.equal(K8.dequantize_experts(fe, torch.float64), full)


# ---- the experts kernels on float8 weights (the interpreter on the CPU, in fp16; bf16 on CUDA) ------------------

KERNEL_DTYPE = torch.bfloat16 if HAS_CUDA else torch.float16  # the interpreter's bf16 tl.dot is wrong
BAR = 2e-2 if HAS_CUDA else 5e-3  # h rounded to x's dtype once, y once


def kernel_case(fmt, block, seed, interleaved=False, **shape):
    x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64) = case(fmt, block, seed=seed, **shape)
    dev = KERNEL_DEVICE
    x = (x * 4).to(KERNEL_DTYPE)  # outputs of O(1)
    fgu = K8.fp8_experts(wgu.to(dev), sgu.to(dev), block, gated=True, interleaved=interleaved)
    fd = K8.fp8_experts(wd.to(dev), sd.to(dev), block)
    return (x.to(dev), ids.to(dev), wts.to(dev), fgu, fd), (x, ids, wts, wgu64, wd64)


@pytest.mark.parametrize("path", ["pairs", "sorted", "sorted_fused_nomemset", "unsorted", "sorted_tma"])
@pytest.mark.parametrize("fmt,block", FORMATS + [("block", (16, 16))])
def test_experts_kernels_read_float8_weights(path, fmt, block):
    """Each path's kernels on float8 weights and their scales (per K step, per row once), sentinel ids among the
    routing, against float64 on the weights the scales describe; outputs start as NaN."""
    (x, ids, wts, fgu, fd), ref = kernel_case(fmt, block, seed=7)
    with poisoned_empty():
        y = kmoe.moe_experts(x, ids, wts, fgu.w, None, fd.w, None, kmoe.ExpertAct(), False, path, scales=(fgu, fd))
    assert y.dtype == KERNEL_DTYPE and y.shape == x.shape
    expected = reference64(*ref)
    assert expected.abs().max() > 0.1
    assert rel_err(y.cpu(), expected, math.inf) < BAR


# the grouped paths; with the pairs' rows in x's dtype (config.moe_rows_lowp), one path of each combine (a launch of
# its own, in down)
PLAN_CASES = [(path, a8, fmt, block, False) for path in ("sorted", "sorted_fused_nomemset", "unsorted", "unsorted_pdl")
              for a8 in (False, True) for fmt, block in (("block", (32, 64)), ("channel", None))]
PLAN_CASES += [(path, a8, "block", (32, 64), True) for path in ("sorted", "unsorted_pdl") for a8 in (False, True)]
PLAN_CASES += [("sorted_tma", True, "block", (32, 64), False), ("sorted_tma", True, "channel", None, True)]  # TMA


@pytest.mark.parametrize("path,a8,fmt,block,lowp", PLAN_CASES)
def test_fp8_grouped_plan_replays_moe_experts(path, a8, fmt, block, lowp, monkeypatch):
    """The grouped paths' plans (launches worked out once) give moe_experts' output bit for bit, on another call's
    inputs and scales of the same signature too (another layer's)."""
    monkeypatch.setattr(config, "moe_rows_lowp", lowp)
    (x, ids, wts, fgu, fd), _ = kernel_case(fmt, block, seed=13)
    plan = kmoe.experts_plan(x, ids, wts, fgu.w, None, fd.w, None, kmoe.ExpertAct(), False, path,
                             scales=(fgu, fd), a8=a8)
    (x2, ids2, wts2, fgu2, fd2), _ = kernel_case(fmt, block, seed=14)
    for xx, ii, ww, gu, d in ((x, ids, wts, fgu, fd), (x2, ids2, wts2, fgu2, fd2)):
        with poisoned_empty():
            y = plan(xx, ii, ww, gu.w, None, d.w, None, (gu, d))
        want = kmoe.moe_experts(xx, ii, ww, gu.w, None, d.w, None, kmoe.ExpertAct(), False, path,
                                scales=(gu, d), a8=a8)
        assert torch.equal(y, want)
    assert not torch.equal(y, plan(x, ids, wts, fgu.w, None, fd.w, None, (fgu, fd)))


@pytest.mark.parametrize("path", ["pairs", "sorted"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_experts_kernels_fp8_clamped_gate(path, interleaved):
    """GPT-OSS's gate (clamped, up + 1) in either layout of gate and up rows (scale rows follow the layout)."""
    (x, ids, wts, fgu, fd), (x64, ids64, wts64, wgu64, wd64) = kernel_case("block", (32, 64), seed=8,
                                                                          interleaved=interleaved)
    x, x64 = x * 3, x64 * 3
    act = kmoe.ExpertAct("silu", limit=0.7, up_offset=1.0)
    with poisoned_empty():
        y = kmoe.moe_experts(x, ids, wts, fgu.w, None, fd.w, None, act, interleaved, path, scales=(fgu, fd))
    expected = reference64(x64, ids64, wts64, wgu64, wd64, limit=0.7, up_offset=1.0, interleaved=interleaved)
    assert rel_err(y.cpu(), expected, math.inf) < BAR


@pytest.mark.parametrize("T,w8a8", [(2, True), (30, True), (30, False)])
def test_quant_moe_mlp_runs_the_kernels(T, w8a8, monkeypatch):
    """The op runs the kernels where they can run (here: Triton on the CPU tensors), with no dequantized weight: the
    sorted path at every size, W8A8 unless config.fp8_w8a8 is off."""
    if not HAS_CUDA:
        monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(config, "fp8_w8a8", w8a8)
    calls = []
    real = kmoe.experts_plan
    monkeypatch.setattr(kmoe, "experts_plan", lambda *a, **kw: calls.append((a[9], kw["a8"])) or real(*a, **kw))
    monkeypatch.setattr(fp8_experts, "_PLANS", {})
    monkeypatch.setattr(K8, "dequantize_experts", None)  # a dequantized copy would fail the call
    if HAS_CUDA:  # there the table times its rows at a few tokens (one-token rows, the one-launch kernel): forced
        monkeypatch.setattr(config, "force_impl", "fp8_moe_sorted_w8a8" if w8a8 else "fp8_moe_sorted_w8a16")
    x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64) = case("block", (32, 64), T=T, seed=9)
    dev = KERNEL_DEVICE
    args = (x.to(dev, KERNEL_DTYPE), ids.to(dev), wts.to(dev), wgu.to(dev), sgu.to(dev), wd.to(dev), sd.to(dev))
    y = quant_moe.quant_moe_mlp(*args, "silu", block=(32, 64))
    a8 = w8a8
    assert calls == [("sorted", a8)]  # the plan built once, run again by the next call
    sd2 = sd.to(dev) * 2  # another layer's scales, the same signature: its own values
    assert torch.equal(quant_moe.quant_moe_mlp(*args, "silu", block=(32, 64)), y) and len(calls) == 1
    assert rel_err(quant_moe.quant_moe_mlp(*args[:6], sd2, "silu", block=(32, 64)).float(), 2 * y.float()) < 2e-3
    ref = (reference64_a8 if a8 else lambda *a: reference64(*a[:5]))(x.to(KERNEL_DTYPE), ids, wts, wgu64, wd64,
                                                                      KERNEL_DTYPE)
    assert rel_err(y.cpu(), ref, math.inf) < BAR


# (T with k = 3, scale format and block, config.triton_on_cpu, config.fp8_w8a8) -> the path the op takes on CPU tensors
CHOICES = [
    ((1, "block", (32, 64), True, True), ("sorted", True)),  # one token: the grouped GEMMs too, W8A8
    ((22, "block", (32, 64), True, True), ("sorted", True)),
    ((22, "block", (32, 64), True, False), ("sorted", False)),  # W8A8 off: W8A16
    ((40, "channel", None, True, True), ("sorted", True)),
    ((5, "tensor", None, True, False), ("sorted", False)),
    ((22, "block", (32, 64), False, True), "dequantize"),  # CPU tensors without the interpreter: the reference
    ((5, "block", (32, 8), True, True), "dequantize"),  # scale blocks 8 wide along K: the kernels step K by 16
]


@pytest.mark.parametrize("shape,want", CHOICES, ids=str)
def test_quant_moe_mlp_chooses_its_path_per_shape(shape, want, monkeypatch):
    """Which path the op takes for a call (what the kernels' plan is built for, or the dequantized reference)."""
    T, fmt, block, on_cpu, w8a8 = shape
    monkeypatch.setattr(config, "triton_on_cpu", on_cpu)
    monkeypatch.setattr(config, "fp8_w8a8", w8a8)
    monkeypatch.setattr(fp8_experts, "_PLANS", {})
    taken = []
    monkeypatch.setattr(kmoe, "experts_plan", lambda *a, **kw: taken.append((a[9], kw["a8"])) or (
        lambda x, *rest: torch.zeros_like(x)))  # the choice only: no kernel runs
    real = K8.dequantize_experts
    monkeypatch.setattr(K8, "dequantize_experts", lambda *a: taken.append("dequantize") or real(*a))
    x, ids, wts, weights, _ = case(fmt, block, T=T, seed=12)
    quant_moe.quant_moe_mlp(x, ids, wts, *weights, "silu", block=block)
    assert taken == ([want] if want != "dequantize" else ["dequantize"] * 2)  # gate/up's and down's


@requires_cuda
@pytest.mark.parametrize("T", [1, 64])
def test_quant_moe_mlp_makes_no_dequantized_copy_on_cuda(T):
    """The weights are read as stored: the call's peak memory stays far below a bf16 copy of either weight."""
    g = torch.Generator().manual_seed(10)
    E, H, I = 16, 1024, 512
    wgu, sgu, _ = quantized_experts(E, 2 * I, H, "block", (128, 128), g)
    wd, sd, _ = quantized_experts(E, H, I, "block", (128, 128), g)
    ids, wts = routing(g, T, 4, E)
    x = torch.randn(T, H, generator=g).cuda().bfloat16()
    args = [t.cuda() for t in (ids, wts, wgu, sgu, wd, sd)]
    quant_moe.quant_moe_mlp(x, *args, "silu", block=(128, 128))  # compiled before measuring
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    quant_moe.quant_moe_mlp(x, *args, "silu", block=(128, 128))
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < wd.numel()  # a bf16 copy of w_down alone: 2 x its fp8 bytes


def test_a_seen_signature_still_checks_what_changes():
    """A call like one seen before skips the shape checks, not the ids' check; another signature is checked afresh;
    the eager entry computes what the op does."""
    x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64) = case("block", (32, 64), seed=11)
    op = quant_moe.quant_moe_mlp
    for _ in range(2):
        assert rel_err(op(x, ids, wts, wgu, sgu, wd, sd, "silu", block=(32, 64)),
                       reference64(x, ids, wts, wgu64, wd64)) < 1e-5
    with pytest.raises(ValueError, match="topk_ids holds -1"):
        op(x, ids - 1 - ids.clamp(max=0), wts, wgu, sgu, wd, sd, "silu", block=(32, 64))
    with pytest.raises(ValueError, match=r"got \(4, 2, 1\) \(argument 'w_down'\)"):
        op(x, ids, wts, wgu, sgu, wd, sd[:, :2], "silu", block=(32, 64))
    eager = quant_moe.eager_quant_moe_mlp(x, ids, wts, wgu, sgu, wd, sd, "silu", "fp8_e4m3", [32, 64])
    assert torch.equal(eager, op(x, ids, wts, wgu, sgu, wd, sd, "silu", block=(32, 64)))


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("fmt,block", FORMATS)
def test_a_seen_signature_reads_each_calls_own_scales(fmt, block, kernels, monkeypatch):
    """A later call of a checked signature builds its weights' scale views from what the first call found: another
    layer's call gives what a first call on that layer gives (the kernels' plan, or the dequantized reference)."""
    if kernels and KERNEL_DEVICE is None:
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    monkeypatch.setattr(config, "triton_on_cpu", kernels)
    dev, dt = (KERNEL_DEVICE, KERNEL_DTYPE) if kernels else ("cpu", torch.float32)

    def layer(seed):
        x, ids, wts, weights, _ = case(fmt, block, seed=seed)
        return (x.to(dev, dt), ids.to(dev), wts.to(dev), *(t.to(dev) for t in weights))

    one, two = layer(21), layer(22)
    monkeypatch.setattr(quant_moe, "_SEEN", {})
    monkeypatch.setattr(fp8_experts, "_PLANS", {})
    quant_moe.quant_moe_mlp(*one, "silu", block=block)
    y = quant_moe.quant_moe_mlp(*two, "silu", block=block)
    monkeypatch.setattr(quant_moe, "_SEEN", {})
    monkeypatch.setattr(fp8_experts, "_PLANS", {})
    assert torch.equal(y, quant_moe.quant_moe_mlp(*two, "silu", block=block))


def reference64_a8(x, ids, wts, wgu, wd, dtype, act="silu", gated=True):
    """What W8A8 computes, in float64: x quantized per row and 128 columns, h rounded to x's dtype and quantized
    likewise (transformers' dynamic scheme), the weights as their scales describe them. The activations are
    quantized by aten on the kernels' device: CUDA's aten takes amax / 448 as amax · (1 / 448), the CPU's divides,
    and a scale an ulp apart moves float8 roundings at ties, which a float64 check then reads as error."""
    def deq(t):
        q, s = (u.cpu() for u in K8.quantize_rows_reference(t.to(KERNEL_DEVICE)))
        return q.double() * s.double().repeat_interleave(K8.A8_BLOCK, 1)[:, :t.shape[1]]

    T, k = ids.shape
    E = wgu.shape[0]
    xq = deq(x)
    y = torch.zeros(T, wd.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e < E:
                fn = {"silu": F.silu, "gelu": F.gelu}[act]
                gu = wgu[e] @ xq[t]
                g, u = gu.chunk(2) if gated else (gu, 1.0)
                h = deq((fn(g) * u).to(dtype)[None])[0]
                y[t] += float(wts[t, j]) * (wd[e] @ h)
    return y


def test_w8a8_needs_k_blocks_of_32(monkeypatch):
    """Scale blocks 16 wide along K: a W8A8 K step would be 16, and float8 dots take 32 at least on the GPU. The
    kernels raise, naming the blocks; the table passes its W8A8 rows over and takes W8A16, saying why."""
    (x, ids, wts, fgu, fd), _ = kernel_case("block", (16, 16), seed=12, H=160)
    with pytest.raises(ValueError, match="blocks 16 wide along K"):
        kmoe.moe_experts(x, ids, wts, fgu.w, None, fd.w, None, kmoe.ExpertAct(), False, "sorted", scales=(fgu, fd),
                         a8=True)
    monkeypatch.setattr(config, "triton_on_cpu", True)
    p = fp8_experts.problem(x, ids, fgu, fd)
    assert [i.name for i in fp8_experts.eligible(p)] == ["fp8_moe_sorted_w8a16"]
    assert "fp8_moe_sorted_w8a8: w_gate_up's scale blocks 16 wide along K" in fp8_experts.describe(p)
    (x, ids, wts, fgu, fd), _ = kernel_case("block", (16, 32), seed=12, H=160)
    assert fp8_experts.eligible(fp8_experts.problem(x, ids, fgu, fd))[0].name == "fp8_moe_sorted_w8a8"


@pytest.mark.parametrize("path", ["sorted", "sorted_fused", "unsorted"])
@pytest.mark.parametrize("fmt,block", [FORMATS[0], FORMATS[2], ("block", (16, 32))])
def test_experts_kernels_w8a8(path, fmt, block):
    """x and h quantized per row and 128 columns, both operands float8 on the tensor cores, x's scale and the
    weights' per K step (BLOCK_K cut to divide both), against float64 of the same semantics."""
    (x, ids, wts, fgu, fd), (x64, ids64, wts64, wgu64, wd64) = kernel_case(fmt, block, seed=12, H=160)
    with poisoned_empty():
        y = kmoe.moe_experts(x, ids, wts, fgu.w, None, fd.w, None, kmoe.ExpertAct(), False, path, scales=(fgu, fd),
                             a8=True)
    expected = reference64_a8(x64, ids64, wts64, wgu64, wd64, KERNEL_DTYPE)
    assert expected.abs().max() > 0.1
    assert rel_err(y.cpu(), expected, math.inf) < BAR
    assert rel_err(y.cpu(), reference64(x64, ids64, wts64, wgu64, wd64), math.inf) > 1e-3  # x was quantized


# ---- W8A8 with the float8 weight tiles read as TMA boxes (sorted_tma) ------------------------------------------


def tma_case(fmt, block, seed):
    """A W8A8 case for the TMA kernels: H = 160 (two 128-column activation blocks, a K tail), I = 96 (down's scales
    change along K), expert 2 of 4 routed no row, the others' row counts no multiple of the interpreter's BLOCK_M of
    16, sentinel ids among them."""
    (x, ids, wts, fgu, fd), (x64, ids64, wts64, wgu64, wd64) = kernel_case(fmt, block, seed=seed, T=23, H=160, I=96)
    g = torch.Generator().manual_seed(seed)
    ids64 = torch.tensor([0, 1, 3])[torch.randint(0, 3, ids64.shape, generator=g)]
    ids64 = torch.where(torch.rand(ids64.shape, generator=g) < 0.15, sentinels(g, ids64.shape, 4), ids64)
    counts = [int((ids64 == e).sum()) for e in range(4)]
    assert counts[2] == 0 and any(c % 16 for c in counts)
    return (x, ids64.to(ids.device), wts, fgu, fd), (x64, ids64, wts64, wgu64, wd64)


@pytest.mark.parametrize("fmt,block", [FORMATS[0], FORMATS[1], FORMATS[2], ("block", (16, 32))])
def test_sorted_tma_w8a8_reads_float8_boxes(fmt, block, monkeypatch):
    """sorted_tma on float8 weights with float8 activations runs its TMA kernels (float8 weight boxes, x8 and h8
    gathered by pointer, each K step scaled by x's and the weights' scales), against float64 of W8A8's semantics
    and against the pointer kernels (the same tiles under the interpreter: the same bits); outputs start as NaN."""
    (x, ids, wts, fgu, fd), ref = tma_case(fmt, block, seed=31)
    calls, one_scale = [], []
    for name in ("moe_gate_up_tma", "moe_down_tma"):
        real = getattr(kmoe, name)
        monkeypatch.setattr(kmoe, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    real_ws = kmoe.ws_tile
    monkeypatch.setattr(kmoe, "ws_tile", lambda *a: one_scale.append(real_ws(*a)) or one_scale[-1])
    assert kmoe.tma_why_not(x, fgu.w, fd.w, False) is None
    tiles = {kind: {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
             for kind in ("gate_up_tma", "down_tma")}  # the interpreter's, on the GPU too
    with poisoned_empty():
        y = kmoe.moe_experts(x, ids, wts, fgu.w, None, fd.w, None, kmoe.ExpertAct(), False, "sorted_tma",
                             tiles, scales=(fgu, fd), a8=True)
    assert calls == ["moe_gate_up_tma", "moe_down_tma"]
    # one weight scale a K step and tile where the tiles (32 columns here) lie in 32-row scale blocks (up's from row
    # I = 96 too); not in 16-row blocks, nor where the scales do not change along K (per row, per tensor)
    assert one_scale == [fmt in ("block", "apart") and block == (32, 64)] * 2
    expected = reference64_a8(*ref, KERNEL_DTYPE)
    assert expected.abs().max() > 0.1 and y.dtype == KERNEL_DTYPE
    assert rel_err(y.cpu(), expected, math.inf) < BAR
    pointer = kmoe.moe_experts(x, ids, wts, fgu.w, None, fd.w, None, kmoe.ExpertAct(), False, "sorted",
                               scales=(fgu, fd), a8=True)
    if HAS_CUDA:  # other tiles on the GPU: other sums' orders
        assert rel_err(y, pointer, math.inf) < BAR
    else:
        assert torch.equal(y, pointer)


@pytest.mark.usefixtures("exact_fp8_casts")
@pytest.mark.parametrize("fmt,block", [("apart", (128, 128)), ("channel", None)])
def test_tma_gate_up_quantizes_h_as_quantize_rows_does(fmt, block, monkeypatch):
    """quant_h: the TMA gate/up launch writes h in float8 and its scales itself (tiles of 128 columns, one activation
    block), the bits quantize_rows gives h written in x's dtype (the interpreter's float8 casts made torch's), for
    every routed pair (I = 200: a tail of columns; dropped pairs among them); outputs start as NaN. Other tiles, or
    no W8A8, are refused by name; the op takes it where config.fp8_fused_h is on, on the GPU only."""
    (x, ids, wts, fgu, fd), _ = kernel_case(fmt, block, seed=41, T=40, H=256, I=200)
    ids = torch.where(torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)).to(ids.device) < 0.1,
                      sentinels(torch.Generator().manual_seed(3), ids.shape, fd.w.shape[0]).to(ids.device), ids)
    E, H, I = fd.w.shape
    up = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}
    routing = kmoe.moe_align(ids, E, 16)
    xq, xs = K8.quantize_rows(x)
    with poisoned_empty():
        h = kmoe.moe_gate_up_tma(xq, routing, fgu.w, None, kmoe.ExpertAct(), I, up, scale=fgu, xs=xs,
                                 out_dtype=x.dtype)
        hq, hs = kmoe.moe_gate_up_tma(xq, routing, fgu.w, None, kmoe.ExpertAct(), I, up, scale=fgu, xs=xs,
                                      out_dtype=x.dtype, quant_h=True)
    routed = ((ids >= 0) & (ids < E)).reshape(-1)
    assert 0 < int(routed.sum()) < routed.numel() and hq.dtype == K8.FP8 and hs.shape == (ids.numel(), 2)
    want_q, want_s = K8.quantize_rows(h[routed].contiguous())
    assert torch.equal(hs[routed], want_s) and torch.equal(hq[routed].view(torch.uint8), want_q.view(torch.uint8))
    for bad in ({"xs": None}, {"config": {**up, "BLOCK_N": 64}}):
        args = {"scale": fgu, "xs": xs, "out_dtype": x.dtype, "quant_h": True, "config": up, **bad}
        with pytest.raises(ValueError, match="quant_h takes W8A8"):
            kmoe.moe_gate_up_tma(xq, routing, fgu.w, None, kmoe.ExpertAct(), I, **args)
    monkeypatch.setattr(config, "fp8_fused_h", False)
    assert not kmoe.fused_h_quant(up)
    monkeypatch.setattr(config, "fp8_fused_h", True)
    assert kmoe.fused_h_quant(up) is (not kmoe.INTERPRET) and not kmoe.fused_h_quant({**up, "BLOCK_N": 64})


@pytest.mark.usefixtures("exact_fp8_casts")
def test_planned_tma_row_takes_h_quantized_by_gate_up(monkeypatch):
    """The sorted_tma plan with h quantized by its gate/up launch (forced here: under the interpreter the op never
    takes it) gives the unfused plan's bits (the interpreter's float8 casts made torch's), and h's quantization
    launch is never called; a scale read from the wrong row or column gives an error of 1."""
    (x, ids, wts, fgu, fd), ref = kernel_case("apart", (128, 128), seed=43, T=40, H=256, I=256)
    tile = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}
    args = (x, ids, wts, fgu.w, None, fd.w, None, (fgu, fd))

    def planned():
        with poisoned_empty():
            return kmoe.experts_plan(x, ids, wts, fgu.w, None, fd.w, None, kmoe.ExpertAct(), False, "sorted_tma",
                                     {"gate_up_tma": tile, "down_tma": tile}, (fgu, fd), True)(*args)

    unfused = planned()
    assert rel_err(unfused.cpu(), reference64_a8(*ref, KERNEL_DTYPE), math.inf) < BAR
    monkeypatch.setattr(kmoe, "fused_h_quant", lambda up: up["BLOCK_N"] == K8.A8_BLOCK)
    quantized = []
    real = kmoe._quantize_plan

    def counted(*shape):
        quant = real(*shape)
        return lambda t: quantized.append(shape) or quant(t)
    monkeypatch.setattr(kmoe, "_quantize_plan", counted)
    assert torch.equal(planned(), unfused)
    assert quantized == [(40, 256)]  # x's alone: the gate/up launch wrote h8 and its scales


@requires_cuda
def test_fused_h_quant_gives_the_ops_bits(monkeypatch):
    """On the GPU, the FP8 experts op at 256+ rows per expert (the TMA row's 128-column gate/up tiles) gives the
    same bits with h quantized in the gate/up launch as with quantize_rows after it."""
    x, ids, wts, (wgu, sgu, wd, sd), _ = case("apart", (128, 128), T=600, k=2, E=4, H=256, I=256, seed=12)
    args = [t.to("cuda") for t in (x.to(torch.bfloat16), ids, wts, wgu, sgu, wd, sd)]
    monkeypatch.setattr(config, "force_impl", "fp8_moe_sorted_tma_w8a8")
    outs = []
    for on in (False, True):
        monkeypatch.setattr(config, "fp8_fused_h", on)
        monkeypatch.setattr(fp8_experts, "_PLANS", {})
        outs.append(quant_moe.quant_moe_mlp(*args, "silu", block=(128, 128)))
    assert torch.equal(outs[0], outs[1])


def test_fp8_sorted_tma_row_forced_and_planned(monkeypatch):
    """The dispatcher's TMA row: forced, the op plans sorted_tma W8A8 and gives the pointer row's output (bit for bit
    under the interpreter); the plan replays another call of the signature (another layer's weights and scales); a
    candidate from 64 rows per touched expert; where gate and up rows interleave or rows are no 16-byte multiple, it
    says why not."""
    if not HAS_CUDA:
        monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(fp8_experts, "_PLANS", {})
    calls = []
    real = kmoe.experts_plan
    monkeypatch.setattr(kmoe, "experts_plan", lambda *a, **kw: calls.append((a[9], kw["a8"])) or real(*a, **kw))
    dev = KERNEL_DEVICE

    def layer(seed):
        x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64) = case("block", (32, 64), T=23, H=160, seed=seed)
        x = x.to(KERNEL_DTYPE)
        args = (x.to(dev), ids.to(dev), wts.to(dev), wgu.to(dev), sgu.to(dev), wd.to(dev), sd.to(dev))
        return args, reference64_a8(x, ids, wts, wgu64, wd64, KERNEL_DTYPE)

    (one, ref_one), (two, ref_two) = layer(32), layer(33)
    outs = {}
    for row in ("fp8_moe_sorted_tma_w8a8", "fp8_moe_sorted_w8a8"):
        monkeypatch.setattr(config, "force_impl", row)
        outs[row] = [quant_moe.quant_moe_mlp(*args, "silu", block=(32, 64)) for args in (one, two)]
    assert calls == [("sorted_tma", True), ("sorted", True)]  # one plan per row, replayed on the second layer
    for a, b, ref in zip(*outs.values(), (ref_one, ref_two)):
        if HAS_CUDA:  # other tiles, other sums: h's float8 roundings move apart, each within W8A8's bar of float64
            assert rel_err(a.cpu(), ref, math.inf) < BAR and rel_err(b.cpu(), ref, math.inf) < BAR
        else:
            assert torch.equal(a, b)
    monkeypatch.setattr(config, "force_impl", None)

    def problem(T, H=160, interleaved=False):
        (x, ids, wts, fgu, fd), _ = kernel_case("block", (32, 64), seed=34, T=T, H=H, interleaved=interleaved)
        return fp8_experts.problem(x, ids, fgu, fd, Gate("silu", interleaved=interleaved))

    names = [i.name for i in fp8_experts.eligible(problem(86))]  # 258 pairs over 4 experts: 64.5 rows each
    assert names == ["fp8_moe_sorted_w8a8", "fp8_moe_sorted_tma_w8a8"]
    assert "< 64 rows each" in fp8_experts.describe(problem(85))
    interleaved = fp8_experts.describe(problem(86, interleaved=True))
    assert "fp8_moe_sorted_tma_w8a8: gate and up rows interleaved" in interleaved
    assert "16-byte multiples" in fp8_experts.describe(problem(86, H=104))
