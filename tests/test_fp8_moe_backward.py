"""The routed experts' Triton backward on float8 weights (``kernels.moe_backward.moe_backward(scales=...)``): dx and
d topk_weights against float64 autograd on the weights the scales describe, every scale format, called directly (the
interpreter on the CPU, in fp32 and fp16: its bf16 tl.dot is wrong; bf16 too on CUDA)."""

from __future__ import annotations

import pytest
import torch
from _moe_cases import sentinels, stored_transposed
from conftest import HAS_CUDA, KERNEL_DEVICE, poisoned_empty, requires_cuda
from test_fp8_moe import FORMATS, quantized_experts, reference64

from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels.moe import ExpertAct
from mlp_fuser.kernels.moe_backward import moe_backward
from mlp_fuser.reference import rel_err

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
BAR = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # x, dy, h and [dg du] rounded to x's dtype


def fp8_case(fmt, block, dtype, T=19, k=3, E=5, H=96, I=48, gated=True, interleaved=False, transposed=False,
             seed=0):
    """Float8 experts in ``fmt`` with their float64 values; about 20% sentinel ids; no tokens for the last expert."""
    g = torch.Generator().manual_seed(seed)
    N = 2 * I if gated else I
    wgu, sgu, wgu64 = quantized_experts(E, N, H, fmt, block, g, gated)
    dfmt = "block" if fmt == "apart" else "tensor" if fmt == "halves" else fmt
    wd, sd, wd64 = quantized_experts(E, H, I, dfmt, block, g)
    x = torch.randn(T, H, generator=g) * 4  # activations of O(1)
    ids = torch.randint(0, E - 1, (T, k), generator=g)
    ids = torch.where(torch.rand(T, k, generator=g) < 0.2, sentinels(g, (T, k), E), ids)
    wts, dy = torch.rand(T, k, generator=g), torch.randn(T, H, generator=g)
    if transposed:
        wgu, wd = stored_transposed(wgu, wd)
    dev = KERNEL_DEVICE
    fgu = K8.fp8_experts(wgu.to(dev), sgu.to(dev), block, gated, interleaved)
    fd = K8.fp8_experts(wd.to(dev), sd.to(dev), block)
    x, dy = x.to(dtype), dy.to(dtype)
    return (x.to(dev), ids.to(dev), wts.to(dev), fgu, fd, dy.to(dev)), (x, ids, wts, wgu64, wd64, dy)


def grads64(x, ids, wts, wgu64, wd64, dy, **gate):
    """dx and d topk_weights by float64 autograd through the pair-by-pair reference."""
    x64, w64 = x.double().requires_grad_(), wts.double().requires_grad_()
    reference64(x64, ids, w64, wgu64, wd64, **gate).backward(dy.double())
    return x64.grad, w64.grad


SILU = ExpertAct()


def run(args, act=SILU, interleaved=False, need_dx=True):
    x, ids, wts, fgu, fd, dy = args
    with poisoned_empty():
        return moe_backward(x, ids, wts, fgu.w, None, fd.w, None, act, interleaved, dy, need_dx=need_dx,
                            need_weights=False, scales=(fgu, fd))


def check(got, ref, bar):
    (dx, dwts, *weights), (dx64, dwts64) = got, ref
    assert weights == [None] * 4
    assert dx64.abs().max() > 0.1 and dwts64.abs().max() > 0.1
    for name, g, r in (("dx", dx, dx64), ("dwts", dwts, dwts64)):
        err = rel_err(g.cpu(), r)
        assert err <= bar, f"{name}: relative error {err:.2e} > {bar:.0e}"


CASES = [(fmt, block, torch.float32) for fmt, block in FORMATS + [("block", (16, 16)), ("block", (48, 48))]]
CASES += [(fmt, block, dt) for dt in DTYPES[1:] for fmt, block in (FORMATS[1], FORMATS[2])]


@pytest.mark.parametrize("fmt,block,dtype", CASES, ids=str)
def test_fp8_backward_matches_float64(fmt, block, dtype):
    """Every format (blocks along K and N, gate and up quantized apart, per channel, per tensor, per half; blocks
    narrower than the tiles and not dividing them), sentinel ids, an expert with no tokens."""
    args, ref = fp8_case(fmt, block, dtype)
    check(run(args), grads64(*ref), BAR[dtype])


@pytest.mark.parametrize("interleaved", [False, True])
def test_fp8_backward_clamped_gate_and_transposed_storage(interleaved):
    """GPT-OSS's gate (clamped, up + 1) in either layout of gate/up rows, the weights stored transposed."""
    args, ref = fp8_case("block", (32, 64), torch.float32, interleaved=interleaved, transposed=True, seed=1)
    args, ref = (args[0] * 3, *args[1:]), (ref[0] * 3, *ref[1:])  # so that the clamps bite
    gate = dict(limit=0.7, up_offset=1.0, interleaved=interleaved)
    act = ExpertAct("silu", limit=0.7, up_offset=1.0)
    check(run(args, act, interleaved), grads64(*ref, **gate), BAR[torch.float32])


def test_fp8_backward_plain_experts_and_no_dx():
    """Plain experts (act(x W1ᵀ), per-channel scales); without need_dx only d topk_weights is computed."""
    args, ref = fp8_case("channel", None, torch.float32, gated=False, seed=2)
    want = grads64(*ref, act="gelu", gated=False)
    check(run(args, ExpertAct("gelu")), want, BAR[torch.float32])
    dx, dwts, *_ = run(args, ExpertAct("gelu"), need_dx=False)
    assert dx is None and rel_err(dwts.cpu(), want[1]) <= BAR[torch.float32]


def test_fp8_backward_every_pair_dropped_and_refusals():
    args, _ = fp8_case("block", (32, 64), torch.float32, seed=3)
    x, ids, wts, fgu, fd, dy = args
    dx, dwts, *_ = run((x, torch.full_like(ids, fgu.w.shape[0]), wts, fgu, fd, dy))
    assert torch.equal(dx, torch.zeros_like(x)) and torch.equal(dwts, torch.zeros_like(wts))
    with pytest.raises(ValueError, match="frozen"):
        moe_backward(x, ids, wts, fgu.w, None, fd.w, None, ExpertAct(), False, dy, scales=(fgu, fd))
    odd = K8.Fp8Experts(fgu.w, fgu.scale, fgu.block_n, 8)  # scale blocks 8 wide along K: no tile of 16 fits
    with pytest.raises(NotImplementedError, match="8 wide"):
        run((x, ids, wts, odd, fd, dy))


# ---- the op: quant_moe_mlp's backward is quant_moe_mlp_backward, through the kernels where they run ---------------


def op_case(fmt="block", block=(32, 64), dtype=torch.float32, seed=10, **shape):
    """The op's arguments (weights as FP8Experts stores them) on the kernels' device, and the float64 case."""
    g = torch.Generator().manual_seed(seed)
    args, ref = fp8_case(fmt, block, dtype, seed=seed, **shape)
    x, ids, wts, fgu, fd, dy = args
    return (x, ids, wts, fgu.w, fgu.scale, fd.w, fd.scale), dy, ref, g


@pytest.fixture
def kernels(monkeypatch):
    """The kernels' rows take the call (Triton on CPU tensors under the interpreter), no plan or signature kept from
    another test; the rows chosen for the backward are recorded."""
    from mlp_fuser import config
    from mlp_fuser.dispatch import fp8_experts
    from mlp_fuser.ops import quant_moe

    if not HAS_CUDA:
        monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(fp8_experts, "_PLANS", {})
    monkeypatch.setattr(quant_moe, "_SEEN", {})
    chosen = []
    real = fp8_experts.choose_backward
    monkeypatch.setattr(fp8_experts, "choose_backward", lambda p: chosen.append(real(p).name) or real(p))
    return chosen


def test_op_gradients_through_the_kernels_without_a_dequantized_copy(kernels, monkeypatch):
    """x and topk_weights get their gradients from the Triton backward on the float8 weights: the dequantizing
    function is never called (forward or backward); a (T, 1, H) x; only topk_weights asking for one."""
    from mlp_fuser.ops import quant_moe

    monkeypatch.setattr(K8, "dequantize_experts", None)  # a dequantized copy would fail the call
    (x, ids, wts, *weights), dy, ref, _ = op_case()
    xg, wg = x[:, None].clone().requires_grad_(), wts[:, None].clone().requires_grad_()
    y = quant_moe.quant_moe_mlp(xg, ids[:, None], wg, *weights, "silu", block=(32, 64))
    y.backward(dy[:, None])
    dx64, dwts64 = grads64(*ref)
    check((xg.grad[:, 0], wg.grad[:, 0], None, None, None, None), (dx64, dwts64), 1e-5)
    assert kernels == ["fp8_moe_triton_backward"]
    wg = wts.clone().requires_grad_()
    quant_moe.quant_moe_mlp(x, ids, wg, *weights, "silu", block=(32, 64)).backward(dy)
    assert rel_err(wg.grad.cpu(), dwts64) <= 1e-5 and kernels == ["fp8_moe_triton_backward"] * 2
    s_gu = weights[1].clone().requires_grad_()  # only a scale asks for a gradient: frozen, no backward kernel
    y = quant_moe.quant_moe_mlp(x, ids, wts, weights[0], s_gu, *weights[2:], "silu", block=(32, 64))
    assert torch.autograd.grad(y, s_gu, dy, allow_unused=True) == (None,) and len(kernels) == 2


def test_op_backward_compiled_and_opcheck(kernels):
    """Compiled (AOT autograd) the backward graph calls quant_moe_mlp_backward, with eager's gradients; the backward
    op passes opcheck, with and without dx (not test_schema: its mode runs an aten op float8 has no CPU kernel for)."""
    from mlp_fuser.ops import quant_moe

    (x, ids, wts, *weights), dy, ref, _ = op_case(seed=11)

    def f(xx, ww):
        return quant_moe.quant_moe_mlp(xx, ids, ww, *weights, "silu", block=(32, 64))

    xg, wg = x.clone().requires_grad_(), wts.clone().requires_grad_()
    torch.compile(f, backend="aot_eager", fullgraph=True)(xg, wg).backward(dy)
    assert kernels == ["fp8_moe_triton_backward"]
    check((xg.grad, wg.grad, None, None, None, None), grads64(*ref), 1e-5)
    for need_dx in (True, False):
        torch.library.opcheck(torch.ops.mlp_fuser.quant_moe_mlp_backward.default,
                              (dy, x, ids, wts, *weights, "silu", "fp8_e4m3", [32, 64], False, None, False, 0.0,
                               need_dx), test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_op_double_backward_through_the_dequantized_reference():
    """create_graph=True: the gradients are differentiable again (the dequantized reference), equal to float64."""
    from mlp_fuser.ops import quant_moe

    (x, ids, wts, *weights), dy, ref, _ = op_case(seed=12)
    xg, wg = x.clone().requires_grad_(), wts.clone().requires_grad_()
    y = quant_moe.quant_moe_mlp(xg, ids, wg, *weights, "silu", block=(32, 64))
    dx, dwts = torch.autograd.grad(y, (xg, wg), dy, create_graph=True)
    assert dx.requires_grad and dwts.requires_grad
    check((dx.detach(), dwts.detach(), None, None, None, None), grads64(*ref), 1e-5)


def test_backward_table_reasons(monkeypatch):
    """Which backward row runs a call and why the kernels' does not: CPU tensors without the interpreter, scale
    blocks the tiles cannot step in."""
    from mlp_fuser import config
    from mlp_fuser.dispatch import fp8_experts
    from mlp_fuser.reference import Gate

    (x, ids, wts, fgu, fd, dy), _ = fp8_case("block", (32, 64), torch.float32, seed=13)
    monkeypatch.setattr(config, "triton_on_cpu", False)
    p = fp8_experts.backward_problem(x.cpu(), ids, fgu, fd, Gate("silu"))
    assert fp8_experts.choose_backward(p).name == "aten_dequantize"
    assert "fp8_moe_triton_backward: " in fp8_experts.describe_backward(p)
    monkeypatch.setattr(config, "triton_on_cpu", True)
    assert fp8_experts.choose_backward(p).name == "fp8_moe_triton_backward"
    odd = K8.Fp8Experts(fgu.w, fgu.scale, 32, 8)
    p = fp8_experts.backward_problem(x, ids, odd, fd, Gate("silu"))
    assert "8 wide along K" in fp8_experts.describe_backward(p)
    assert fp8_experts.choose_backward(p).name == "aten_dequantize"


@requires_cuda
@pytest.mark.parametrize("T", [1, 256])
def test_op_training_step_makes_no_dequantized_copy_on_cuda(T):
    """Forward and backward with x and topk_weights needing gradients: the peak memory stays far below a bf16 copy
    of either weight (the old path dequantized every expert's weights per call)."""
    from mlp_fuser.ops import quant_moe

    g = torch.Generator().manual_seed(14)
    E, H, I = 16, 2048, 1024  # a bf16 copy of w_down (the bar) twice the backward's activations at T = 256
    wgu, sgu, _ = quantized_experts(E, 2 * I, H, "block", (128, 128), g)
    wd, sd, _ = quantized_experts(E, H, I, "block", (128, 128), g)
    ids = torch.randint(0, E, (T, 4), generator=g).cuda()
    x = torch.randn(T, H, generator=g).cuda().bfloat16().requires_grad_()
    wts = torch.rand(T, 4, generator=g).cuda().requires_grad_()
    dy = torch.randn(T, H, generator=g).cuda().bfloat16()
    weights = [t.cuda() for t in (wgu, sgu, wd, sd)]

    def step():
        quant_moe.quant_moe_mlp(x, ids, wts, *weights, "silu", block=(128, 128)).backward(dy)

    step()  # compiled before measuring
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < wd.numel()  # a bf16 copy of w_down alone: 2 x its fp8 bytes
