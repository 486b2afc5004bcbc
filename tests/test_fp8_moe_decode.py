"""FP8 routed experts at decode sizes, W8A8: x quantized inside the gate/up GEMM and h inside the down GEMM (their
K steps one 128-column activation block), the same bits as quantize_rows then the GEMMs, two launches fewer."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import HAS_CUDA, KERNEL_DEVICE, poisoned_empty
from test_fp8_moe import quantized_experts, reference64, reference64_a8, routing

from mlp_fuser import config
from mlp_fuser.dispatch import core, fp8_experts
from mlp_fuser.dispatch import fp8 as dispatch_fp8
from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels import moe as kmoe
from mlp_fuser.ops import quant_moe
from mlp_fuser.reference import Gate, rel_err

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


# ---- one token: the unsorted rows of the FP8 experts table (dispatch/fp8_experts.py) ----------------------------

W8A8_ROWS = ["fp8_moe_sorted_w8a8", "fp8_moe_unsorted_w8a8", "fp8_moe_unsorted_pdl_w8a8"]
W8A16_ROWS = ["fp8_moe_sorted_w8a16", "fp8_moe_unsorted_w8a16", "fp8_moe_unsorted_pdl_w8a16"]
ONE = "fp8_moe_one_launch"  # W8A16 in one launch, timed at a few pairs (test_fp8_moe_one.py)


def one_token(fmt, gated, seed, device=KERNEL_DEVICE):
    """One token's op arguments on ``device`` (k = 4 of 6 experts, its last pair dropped by a sentinel id) and
    float64 weights: 128 x 128 scale blocks (H two blocks, I one) or a scale per channel."""
    g = torch.Generator().manual_seed(seed)
    E, H, I, k = 6, 256, 128, 4
    block = (128, 128) if fmt == "block" else None
    wgu, sgu, wgu64 = quantized_experts(E, 2 * I if gated else I, H, fmt, block, g)
    wd, sd, wd64 = quantized_experts(E, H, I, fmt, block, g)
    x = torch.randn(1, H, generator=g) * 4
    ids, wts = routing(g, 1, k, E)
    ids[0, -1] = E + 1
    dtype, dev = DTYPES[seed % len(DTYPES)], device
    args = (x.to(dev, dtype), ids.to(dev), wts.to(dev), *(t.to(dev) for t in (wgu, sgu, wd, sd)))
    return args, block, (x.to(dtype), ids, wts, wgu64, wd64)


@pytest.mark.parametrize("a8,in_gemm,fmt,gated", [
    (True, True, "block", True), (True, True, "channel", True), (True, True, "block", False),
    (True, False, "block", True),  # x and h by quantize_rows
    (False, False, "block", True), (False, False, "channel", False)])
def test_one_token_unsorted_rows_give_the_sorted_rows_bits(monkeypatch, a8, in_gemm, fmt, gated):
    """At one token each unsorted row (every pair its own block, down+combine in one launch) gives the sorted row of
    its scheme bit for bit (W8A8: x and h quantized in the GEMMs where BLOCK_K is 128, else by quantize_rows; W8A16),
    a dropped pair among the ids, and float64 of that scheme's semantics."""
    monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(config, "fp8_w8a8", a8)
    monkeypatch.setattr(fp8_experts, "_PLANS", {})
    # K steps of 128 columns: the GEMMs quantize their activations themselves; of 32: quantize_rows does
    forced = {"gate_up": cfg(32, 128 if in_gemm else 32), "down": cfg(64, 128 if in_gemm else 32)}
    real = kmoe.default_config
    monkeypatch.setattr(kmoe, "default_config", lambda kind, *a: dict(forced.get(kind) or real(kind, *a)))
    args, block, ref = one_token(fmt, gated, seed=31 + 2 * gated + in_gemm)
    act = "silu" if gated else "gelu"
    made = counting(monkeypatch)
    ys = {}
    for name in W8A8_ROWS if a8 else W8A16_ROWS:
        monkeypatch.setattr(config, "force_impl", name)
        with poisoned_empty():
            ys[name] = quant_moe.quant_moe_mlp(*args, act, block=block)
    assert made == ([] if in_gemm or not a8 else ["_quantize_plan"] * 6)  # x's and h's, per row
    first, *others = ys.values()
    assert all(torch.equal(first, y) for y in others)
    expected = (reference64_a8(*ref, ref[0].dtype, act=act, gated=gated) if a8 else
                reference64(*ref, act=act, gated=gated))
    assert expected.abs().max() > 0.1
    assert rel_err(first.cpu(), expected, math.inf) < BAR


def _problem(T, monkeypatch, on_cpu=True, device=KERNEL_DEVICE):
    monkeypatch.setattr(config, "triton_on_cpu", on_cpu)
    (x, ids, wts, wgu, sgu, wd, sd), block, _ = one_token("block", True, seed=40, device=device)
    x, ids = x.expand(T, -1), ids.expand(T, -1)
    fgu = K8.fp8_experts(wgu, sgu, block, gated=True)
    fd = K8.fp8_experts(wd, sd, block)
    args = (x, ids, wts.expand(T, -1), fgu, fd, Gate("silu"))
    return fp8_experts.problem(x, ids, fgu, fd, Gate("silu")), args


def names(rows):
    return [i.name for i in rows]


def test_one_token_rows_are_candidates_at_one_token_only(monkeypatch):
    """Which rows are timed: at T = 1 the sorted row and the unsorted ones of the config's scheme, from T = 2 the
    sorted row alone (nothing to time); where the kernels cannot run, the dequantized copy; a forced row runs
    wherever it can."""
    monkeypatch.setattr(config, "fp8_one_launch", False)  # first the two-launch rows alone
    p1, args = _problem(1, monkeypatch, device="cpu")  # the CPU's rule for choosing: no timing, the first row
    p2, _ = _problem(2, monkeypatch, device="cpu")
    assert names(fp8_experts.eligible(p1)) == W8A8_ROWS and names(fp8_experts.eligible(p2)) == W8A8_ROWS[:1]
    assert f"{ONE}: not timed: mlp_fuser.config.fp8_one_launch is off" in fp8_experts.describe(p1)
    monkeypatch.setattr(config, "fp8_one_launch", True)  # then also timed at a few tokens (test_fp8_moe_one.py)
    assert names(fp8_experts.eligible(p1)) == [*W8A8_ROWS, ONE] and names(fp8_experts.eligible(p2))[0] == W8A8_ROWS[0]
    monkeypatch.setattr(config, "fp8_one_launch", False)
    assert fp8_experts.choose(p1, args).name == "fp8_moe_sorted_w8a8"  # the CPU: no timing, the first
    assert "fp8_moe_unsorted_pdl_w8a8: not timed: 2 tokens > 1" in fp8_experts.describe(p2)
    assert "fp8_moe_sorted_w8a16: not timed: mlp_fuser.config.fp8_w8a8 is on" in fp8_experts.describe(p1)
    monkeypatch.setattr(config, "fp8_w8a8", False)
    assert names(fp8_experts.eligible(p1)) == W8A16_ROWS and names(fp8_experts.eligible(p2)) == W8A16_ROWS[:1]
    monkeypatch.setattr(config, "force_impl", "fp8_moe_unsorted_w8a16")
    assert names(fp8_experts.eligible(p2)) == ["fp8_moe_unsorted_w8a16"]
    monkeypatch.setattr(config, "force_impl", "fp8_moe_unsorted_pdl_w8a8")
    with pytest.raises(ValueError, match="fp8_w8a8 is off"):
        fp8_experts.eligible(p1)
    monkeypatch.setattr(config, "force_impl", None)
    off, _ = _problem(1, monkeypatch, on_cpu=False, device="cpu")
    assert names(fp8_experts.eligible(off)) == ["aten_dequantize"]


def test_one_token_choice_is_timed_once_and_kept_with_its_plans(monkeypatch):
    """On CUDA (stood in for here) a T = 1 signature's rows are timed once: plain calls take the eager choice,
    captures the graph one, each through a plan built once; a first call inside a capture takes the first row,
    untimed and unkept; T = 2 has one candidate and is not timed."""
    monkeypatch.setattr(dispatch_fp8, "why_not_kernels", lambda *a: None)
    monkeypatch.setattr(config, "fp8_one_launch", False)  # the two-launch rows (the one launch: test_fp8_moe_one.py)
    real = fp8_experts.problem
    monkeypatch.setattr(fp8_experts, "problem", lambda *a: real(*a)._replace(device="cuda"))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    timed = []
    monkeypatch.setattr(core, "time_candidates", lambda reg, found, args, p: timed.append(names(found)) or (
        "fp8_moe_unsorted_pdl_w8a8", "fp8_moe_unsorted_w8a8"))
    core.reset(fp8_experts.FP8_EXPERTS)
    monkeypatch.setattr(fp8_experts, "_PLANS", {})
    plans = []
    real_plan = kmoe.experts_plan
    monkeypatch.setattr(kmoe, "experts_plan", lambda *a, **kw: plans.append(a[9]) or real_plan(*a, **kw))
    (x, ids, wts, fgu, fd, gate) = _problem(1, monkeypatch)[1]
    p = fp8_experts.problem(x, ids, fgu, fd, gate)
    capturing[0] = True
    assert fp8_experts.choose(p, (x, ids, wts, fgu, fd, gate)).name == "fp8_moe_sorted_w8a8"
    assert fp8_experts.run(x, ids, wts, fgu, fd, gate, ("sig",)) is not None
    assert timed == [] and fp8_experts._PLANS == {} and fp8_experts.chosen(p) is None
    capturing[0] = False
    y = fp8_experts.run(x, ids, wts, fgu, fd, gate, ("sig",))
    assert timed == [W8A8_ROWS]
    assert fp8_experts.chosen(p) == "fp8_moe_unsorted_w8a8 (graphs: fp8_moe_unsorted_pdl_w8a8)"
    assert plans == ["sorted", "unsorted", "unsorted_pdl"]  # the captured call's, then the kept choice's two
    assert torch.equal(fp8_experts.run(x, ids, wts, fgu, fd, gate, ("sig",)), y)
    assert fp8_experts.choose(p, None).name == "fp8_moe_unsorted_w8a8"
    capturing[0] = True
    assert fp8_experts.choose(p, None).name == "fp8_moe_unsorted_pdl_w8a8"
    assert len(timed) == 1 and len(plans) == 3
    p2 = fp8_experts.problem(*_problem(2, monkeypatch)[1][:2], fgu, fd, gate)
    assert fp8_experts.choose(p2, _problem(2, monkeypatch)[1]).name == "fp8_moe_sorted_w8a8" and len(timed) == 1
    core.reset(fp8_experts.FP8_EXPERTS)
