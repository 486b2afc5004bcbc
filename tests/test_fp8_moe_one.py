"""The one-launch FP8 experts kernel (``kernels/moe_one.py``: gate/up, h on chip, down and the combine in one
launch) against float64 on the weights the scales describe: block scales with K tails, per-channel scales, sentinel
ids, slices of I past its end, GPT-OSS's gate, plain experts, a few tokens, the plan's kept accumulator; and its row
in the FP8 experts table (``fp8_moe_one_launch``): forced through the op, where it is timed, why not elsewhere."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import HAS_CUDA, KERNEL_DEVICE, poisoned_empty
from test_fp8_moe import case, reference64

from mlp_fuser import config
from mlp_fuser.dispatch import fp8_experts
from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels import moe as kmoe
from mlp_fuser.kernels import moe_one
from mlp_fuser.ops import quant_moe
from mlp_fuser.reference import Gate, rel_err

DTYPE = torch.bfloat16 if HAS_CUDA else torch.float16  # the interpreter's bf16 is not tested (conftest)
BAR = 2e-2 if HAS_CUDA else 5e-3  # W8A16: h rounded to x's dtype once, y once (test_fp8_moe's bar)


def one_case(fmt, block, T=1, k=4, E=6, H=200, I=80, seed=0, interleaved=False, gated=True, sentinel=None):
    """Device inputs (x, ids, wts, Fp8Experts of gate/up and down) and the float64 reference's (x, ids, wts, the
    weights the scales describe); ``sentinel``: that id in pair (0, 1)."""
    x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64) = case(fmt, block, T=T, k=k, E=E, H=H, I=I, gated=gated,
                                                          seed=seed)
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(seed + t))[:k] for t in range(T)])
    if sentinel is not None:
        ids[0, 1] = sentinel
    x = (x * 4).to(DTYPE)  # outputs of O(1)
    dev = KERNEL_DEVICE
    fgu = K8.fp8_experts(wgu.to(dev), sgu.to(dev), block, gated=gated, interleaved=interleaved)
    fd = K8.fp8_experts(wd.to(dev), sd.to(dev), block)
    return (x.to(dev), ids.to(dev), wts.to(dev), fgu, fd), (x, ids, wts, wgu64, wd64)


# (format, block, H, I, config): 128 x 128 blocks, gate and up quantized apart (I 80: not a block's multiple), H 200
# a K tail of gate/up (BLOCK_K 128) and I 80 a slice past I's end (BLOCK_I 32); 128-blocks along I = 256 (down's
# scales change between slices) with N steps of 64 over H 200 (the rotated start, a tail) and K steps of 64 (two a
# scale block); per channel; 32 x 64
# blocks (BLOCK_K halved to 64, BLOCK_I 32 dividing 64); WIDE's 128-column slices (8 warps) over I 256
CASES = [
    ("apart", (128, 128), 200, 80, None),
    ("block", (128, 128), 200, 256, dict(BLOCK_N=64, BLOCK_K=64)),
    ("channel", None, 96, 40, None),
    ("block", (32, 64), 96, 48, dict(BLOCK_I=16, BLOCK_N=32)),
    ("block", (128, 128), 200, 256, moe_one.WIDE[128]),
]


@pytest.mark.parametrize("fmt,block,H,I,cfg", CASES, ids=str)
def test_one_launch_matches_float64(fmt, block, H, I, cfg):
    (x, ids, wts, fgu, fd), ref = one_case(fmt, block, H=H, I=I, seed=1)
    with poisoned_empty():
        y = moe_one.moe_one(x, ids, wts, fgu, fd, config=cfg)
    assert y.dtype == DTYPE and y.shape == x.shape
    expected = reference64(*ref)
    assert expected.abs().max() > 0.1
    assert rel_err(y.cpu(), expected, math.inf) < BAR


@pytest.mark.parametrize("sentinel", [6, 2**31 - 1])
def test_one_launch_sentinel_contributes_nothing(sentinel):
    """A sentinel id (>= E) among the token's top-k: its programs count themselves in and add nothing; a token of
    sentinels alone gets zeros."""
    (x, ids, wts, fgu, fd), ref = one_case("apart", (128, 128), seed=2, sentinel=sentinel)
    with poisoned_empty():
        y = moe_one.moe_one(x, ids, wts, fgu, fd)
    assert rel_err(y.cpu(), reference64(*ref), math.inf) < BAR
    with poisoned_empty():
        none = moe_one.moe_one(x, torch.full_like(ids, sentinel), wts, fgu, fd)
    assert torch.equal(none, torch.zeros_like(x))


@pytest.mark.parametrize("interleaved", [False, True])
def test_one_launch_gates(interleaved):
    """GPT-OSS's gate (clamped, up + 1) with gate and up rows concatenated or interleaved (scale rows follow);
    plain experts, act(x @ W1ᵀ) with gelu."""
    (x, ids, wts, fgu, fd), (x64, ids64, wts64, wgu64, wd64) = one_case("block", (32, 64), H=96, I=48, seed=3,
                                                                        interleaved=interleaved)
    act = kmoe.ExpertAct("silu", limit=0.7, up_offset=1.0)
    with poisoned_empty():
        y = moe_one.moe_one(x * 3, ids, wts, fgu, fd, act, interleaved)
    expected = reference64(x64 * 3, ids64, wts64, wgu64, wd64, limit=0.7, up_offset=1.0, interleaved=interleaved)
    assert rel_err(y.cpu(), expected, math.inf) < BAR
    (x, ids, wts, fgu, fd), ref = one_case("channel", None, H=96, I=48, seed=4, gated=False)
    with poisoned_empty():
        y = moe_one.moe_one(x, ids, wts, fgu, fd, kmoe.ExpertAct("gelu"))
    assert rel_err(y.cpu(), reference64(*ref, act="gelu", gated=False), math.inf) < BAR


def test_one_launch_plan_keeps_its_accumulator_zeroed():
    """A plan for three tokens called again on another call's inputs and scales (another layer's): the finish sets
    its kept accumulator back to 0, so each call stands alone."""
    (x, ids, wts, fgu, fd), ref = one_case("apart", (128, 128), T=3, seed=5)
    (x2, ids2, wts2, fgu2, fd2), ref2 = one_case("apart", (128, 128), T=3, seed=6)
    plan = moe_one.one_plan(x, ids, wts, fgu, fd)
    for (xx, ii, ww, gu, d), r in (((x, ids, wts, fgu, fd), ref), ((x2, ids2, wts2, fgu2, fd2), ref2),
                                   ((x, ids, wts, fgu, fd), ref)):
        with poisoned_empty():
            y = plan(xx, ii, ww, gu.w, None, d.w, None, (gu, d))
        assert rel_err(y.cpu(), reference64(*r), math.inf) < BAR


def test_one_config_fits_the_scale_blocks():
    (_, _, _, fgu, fd), _ = one_case("block", (16, 16), H=96, I=48)
    assert moe_one.one_config(fgu, fd, 1) == dict(moe_one.DEFAULT, BLOCK_K=16, BLOCK_I=16)
    assert moe_one.one_config(fgu, fd, 400) == dict(moe_one.DEFAULT, BLOCK_K=16, BLOCK_I=16)  # I < 64
    (_, _, _, fgu, fd), _ = one_case("channel", None, H=96, I=48)
    assert moe_one.one_config(fgu, fd, 1) == moe_one.DEFAULT  # one scale along K: nothing to fit
    assert moe_one.one_why_not(fgu, fd) is None
    (_, _, _, fgu, fd), _ = one_case("block", (32, 8), H=96, I=48)
    assert "8 wide along K" in moe_one.one_why_not(fgu, fd)


def test_one_config_widens_the_slices_while_the_grid_stays_full():
    """BLOCK_I 128 where pairs · ⌈I/128⌉ programs still fill the GPU (Mixtral-8x7B's two pairs of I 14336), 64 where
    only that does (Qwen3-30B-A3B's 4 tokens), 32 below (its one token); a given config is taken as it is."""
    def experts(I):
        fgu = K8.fp8_experts(torch.zeros(2, 2 * I, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 2 * I // 128, 2),
                             (128, 128), gated=True)
        return fgu, K8.fp8_experts(torch.zeros(2, 256, I, dtype=torch.float8_e4m3fn), torch.ones(2, 2, I // 128),
                                   (128, 128))
    assert moe_one.one_config(*experts(14336), 2) == moe_one.WIDE[128]
    assert moe_one.one_config(*experts(768), 32) == moe_one.WIDE[64]
    assert moe_one.one_config(*experts(768), 8) == moe_one.DEFAULT
    assert moe_one.one_config(*experts(14336), 2, dict(BLOCK_I=32)) == dict(moe_one.DEFAULT, BLOCK_I=32)


@pytest.mark.skipif(not HAS_CUDA, reason="many programs: the interpreter runs them one by one, in order")
def test_one_launch_many_programs_on_the_gpu():
    """Experts of Qwen3-30B-A3B's shape (16 of its 128) at 16 tokens (3072 programs), three calls of one plan: right
    every call (the sums were once read inside the launch before other programs' atomics had reached them)."""
    E, H, I, k, T = 16, 2048, 768, 8, 16
    g = torch.Generator(device="cuda").manual_seed(7)
    fgu = K8.fp8_experts(*K8.quantize_blocks(torch.randn(E, 2 * I, H, device="cuda", generator=g) / 22, (128, 128)),
                         (128, 128), gated=True)
    fd = K8.fp8_experts(*K8.quantize_blocks(torch.randn(E, H, I, device="cuda", generator=g) / 28, (128, 128)),
                        (128, 128))
    x = torch.randn(T, H, device="cuda", generator=g).to(DTYPE)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, k, device="cuda", generator=g), -1)
    wgu64, wd64 = K8.dequantize_experts(fgu, torch.float64), K8.dequantize_experts(fd, torch.float64)
    expected = reference64(x.cpu(), ids.cpu(), wts.cpu(), wgu64.cpu(), wd64.cpu())
    plan = moe_one.one_plan(x, ids, wts, fgu, fd, config=dict(BLOCK_I=32))
    for _ in range(3):
        with poisoned_empty():
            y = plan(x, ids, wts, fgu.w, None, fd.w, None, (fgu, fd))
        assert rel_err(y.cpu(), expected, math.inf) < BAR


# ---- the dispatcher's row: fp8_moe_one_launch (dispatch/fp8_experts.py) ------------------------------------------


def op_args(T, seed, fmt="apart", block=(128, 128)):
    x, ids, wts, (wgu, sgu, wd, sd), (wgu64, wd64) = case(fmt, block, T=T, k=4, E=6, H=200, I=80, seed=seed)
    ids = torch.stack([torch.randperm(6, generator=torch.Generator().manual_seed(seed + t))[:4] for t in range(T)])
    dev = KERNEL_DEVICE
    x = (x * 4).to(DTYPE)
    args = (x.to(dev), ids.to(dev), wts.to(dev), wgu.to(dev), sgu.to(dev), wd.to(dev), sd.to(dev))
    return args, (x, ids, wts, wgu64, wd64)


@pytest.mark.parametrize("T", [1, 3])
def test_one_launch_row_forced_through_the_op(T, monkeypatch):
    """config.force_impl runs the row through quant_moe_mlp: its plan built once for the signature and replayed on
    another layer's scales (of the same views), within the W8A16 bar of float64; three tokens (forced: not timed
    there) run too."""
    if not HAS_CUDA:
        monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(fp8_experts, "_PLANS", {})
    monkeypatch.setattr(config, "force_impl", "fp8_moe_one_launch")
    plans = []
    real = moe_one.one_plan
    monkeypatch.setattr(moe_one, "one_plan", lambda *a, **kw: plans.append(a[0].shape) or real(*a, **kw))
    args, ref = op_args(T, seed=20)
    with poisoned_empty():
        y = quant_moe.quant_moe_mlp(*args, "silu", block=(128, 128))
    assert rel_err(y.cpu(), reference64(*ref), math.inf) < BAR
    with poisoned_empty():
        y2 = quant_moe.quant_moe_mlp(*args[:6], args[6] * 2, "silu", block=(128, 128))  # down's scales doubled
    assert rel_err(y2.float(), 2 * y.float(), math.inf) < 2e-3
    assert len(plans) == 1


def test_one_launch_row_says_why_not(monkeypatch):
    """Off (config.fp8_one_launch, on by default): not timed; on, a candidate at one token under either setting of
    config.fp8_w8a8 (timed against the two-launch rows) and at a few pairs of mostly distinct experts, not beyond;
    scale blocks 8 wide along K, and CPU tensors without the interpreter, say why it cannot run them; forcing it
    there raises."""
    monkeypatch.setattr(config, "triton_on_cpu", True)

    def problem(T, block=(128, 128), fmt="apart"):
        (x, ids, _, fgu, fd), _ = one_case(fmt, block, T=T)
        return fp8_experts.problem(x.cpu(), ids.cpu(), fgu, fd, Gate("silu"))

    monkeypatch.setattr(config, "fp8_one_launch", False)
    assert "fp8_moe_one_launch" not in [i.name for i in fp8_experts.eligible(problem(1))]
    assert ("fp8_moe_one_launch: not timed: mlp_fuser.config.fp8_one_launch is off"
            in fp8_experts.describe(problem(1)))
    monkeypatch.setattr(config, "fp8_one_launch", True)
    for w8a8 in (True, False):
        monkeypatch.setattr(config, "fp8_w8a8", w8a8)
        names = [i.name for i in fp8_experts.eligible(problem(1))]
        assert "fp8_moe_one_launch" in names and len(names) > 1
    assert "fp8_moe_one_launch: candidate" in fp8_experts.describe(problem(1))
    assert "fp8_moe_one_launch: candidate" in fp8_experts.describe(problem(2))  # 8 pairs over 6 experts
    assert "fp8_moe_one_launch: not timed: 12 pairs over at most 6 experts" in fp8_experts.describe(problem(3))
    qwen3 = problem(1)._replace(shapes=(*problem(1).shapes[:4], ((128, 2048, 768),) + problem(1).shapes[4][1:]))
    assert fp8_experts._few_pairs(qwen3._replace(pairs=32, tokens=4)) is None  # 4 tokens of top-8 over 128 experts
    assert "64 pairs over at most 64 experts (timed up to 32" in fp8_experts._few_pairs(qwen3._replace(pairs=64))
    assert ("fp8_moe_one_launch: w_gate_up's scale blocks are 8 wide along K"
            in fp8_experts.describe(problem(1, (32, 8), "block")))
    monkeypatch.setattr(config, "triton_on_cpu", False)
    assert "fp8_moe_one_launch: x is on cpu: the FP8 kernels run on CUDA" in fp8_experts.describe(problem(1))
    monkeypatch.setattr(config, "force_impl", "fp8_moe_one_launch")
    with pytest.raises(ValueError, match="cannot run"):
        fp8_experts.eligible(problem(1))
