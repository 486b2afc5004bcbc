"""The Triton kernels called directly, against a float64 reference.

Bars: fp32 relative error (‖out − ref‖ / ‖ref‖) ≤ 1e-5; 16-bit dtypes at most 1.25 × the error of the unfused
computation in the same dtype (F.linear and the activation in fp16, as the unfused modules compute it), or of the
"ideal" fused computation if that is larger: float64 throughout except h rounded once and the output rounded once,
the roundings the fused design makes by definition. The second term matters only for outputs of a few elements
where the sum cancels: there one sample of the unfused error is luck (simulated in bf16, a 1x127x3x1 case with
7x cancellation gave the unfused result 0.05% error and the ideal fused one 1.3%).
Shapes are odd, prime and smaller than a block; weights come in every storage layout the op accepts; outputs
are poisoned (torch.empty returns NaN while deterministic mode fills uninitialized memory) so an element the
kernel never writes fails the test.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, poisoned_empty

from mlp_fuser.activations import ACTIVATIONS
from mlp_fuser.dispatch.dense import BACKWARD_BY_NAME, m_bucket
from mlp_fuser.kernels import act_mul, backward, common, fused_mlp_small_m, gate_up_act, gemm, swapab
from mlp_fuser.reference import reference_gate_up, reference_mlp, rel_err

ACTS = sorted(ACTIVATIONS)
SIZES = (1, 3, 5, 127, 130)


def check(out, ref, unfused, ideal, dtype):
    """out, unfused and ideal in `dtype`, ref in float64; the bar of the module docstring."""
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output (an element never written, or NaN read)"
    err = rel_err(out, ref)
    if dtype == torch.float32:
        assert err <= 1e-5, f"fp32 relative error {err:.3g} > 1e-5"
    else:
        unfused_err, ideal_err = rel_err(unfused, ref), rel_err(ideal, ref)
        bar = 1.25 * max(unfused_err, ideal_err)
        assert err <= bar, f"{dtype} relative error {err:.3g} > 1.25 x max(unfused {unfused_err:.3g}, " \
                           f"ideal {ideal_err:.3g})"


# ---- problems -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    M: int
    K: int
    I: int
    O: int
    act: str
    gated: bool
    bias: tuple[bool, bool, bool]  # b_gate, b_up, b_down
    # "linear", "conv1d" (w_t.t() views), "padded" (row stride > row length), "merged" (one (2I, K) gate/up
    # weight), "mixed" (w_gate linear, w_up conv1d: different strides for the two)
    w_layout: str
    x_layout: str  # "contiguous", "strided" (every other column), "transposed" ((K, M) storage)

    def __str__(self):
        b = "".join("b" if on else "-" for on in self.bias)
        return f"{self.M}x{self.K}x{self.I}x{self.O}-{self.act}-{'gated' if self.gated else 'plain'}-{b}-" \
               f"{self.w_layout}-{self.x_layout}"


def _shapes() -> list[Shape]:
    rng = random.Random(1234)
    layouts = ("linear", "conv1d", "padded", "merged", "mixed")

    def draw(M, K, I, O, act=None, gated=None, w_layout=None, x_layout=None):
        gated = rng.random() < 0.7 if gated is None else gated
        w_layout = w_layout or rng.choice(layouts if gated else layouts[:3])
        x_layout = x_layout or rng.choice(("contiguous", "strided", "transposed"))
        return Shape(M, K, I, O, act or rng.choice(ACTS), gated, tuple(rng.random() < 0.5 for _ in range(3)),
                     w_layout, x_layout)

    shapes = [  # corners: all ones, all largest (two blocks in the interpreter's tiles and a remainder)
        draw(1, 1, 1, 1, gated=True, w_layout="merged"),
        draw(17, 130, 130, 130, gated=False, w_layout="conv1d", x_layout="strided"),
        draw(17, 127, 127, 127, gated=True, w_layout="merged", x_layout="transposed"),
        draw(17, 130, 127, 130, gated=True, w_layout="mixed", x_layout="strided"),
        draw(67, 130, 130, 5, gated=True),  # 5 blocks of M: a partial group in gate_up_act's ordering
    ]
    shapes += [draw(rng.choice((1, 17)), *(rng.choice(SIZES) for _ in range(3))) for _ in range(12)]
    shapes += [draw(17, 5, 127, 3, act=a, gated=g) for a in ACTS for g in (True, False)]  # every activation
    return shapes


SHAPES = _shapes()


def _rand(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def make_inputs(s: Shape, dtype, seed: int):
    """(x2, wg, bg, wu, bu, wd, bd), generated on the CPU (the same values on every machine), as views."""
    gen = torch.Generator().manual_seed(seed)

    def dev(t):
        return t.to(dtype).to(KERNEL_DEVICE)

    def weight(out, inp, layout=s.w_layout):
        scale = inp**-0.5
        if layout == "conv1d":
            return dev(_rand(gen, inp, out, scale=scale)).t()
        if layout == "padded":  # rows padded to in + 3: a row stride that is not the row length
            return dev(_rand(gen, out, inp + 3, scale=scale))[:, 1:inp + 1]
        return dev(_rand(gen, out, inp, scale=scale))

    if s.w_layout == "merged":
        w = dev(_rand(gen, 2 * s.I, s.K, scale=s.K**-0.5))
        wg, wu = w[:s.I], w[s.I:]
    elif s.w_layout == "mixed":
        wg, wu = weight(s.I, s.K, "linear"), weight(s.I, s.K, "conv1d")
    else:
        wg = weight(s.I, s.K)
        wu = weight(s.I, s.K) if s.gated else None
    wd = weight(s.O, s.I)
    def bias(n):  # "padded" weights come with strided biases (every other element of a longer vector)
        if s.w_layout == "padded":
            return dev(_rand(gen, 2 * n, scale=0.5))[::2]
        return dev(_rand(gen, n, scale=0.5))

    bg = bias(s.I) if s.bias[0] else None
    bu = bias(s.I) if s.bias[1] and s.gated else None
    if s.w_layout == "merged" and bg is not None and bu is not None:  # a merged gate/up bias, as two views
        b = dev(_rand(gen, 2 * s.I, scale=0.5))
        bg, bu = b[:s.I], b[s.I:]
    bd = bias(s.O) if s.bias[2] else None
    if s.x_layout == "strided":
        x = dev(_rand(gen, s.M, 2 * s.K + 1))[:, 1::2]
    elif s.x_layout == "transposed":
        x = dev(_rand(gen, s.K, s.M)).t()
    else:
        x = dev(_rand(gen, s.M, s.K))
    assert x.shape == (s.M, s.K)
    return x, wg, bg, wu, bu, wd, bd


def _f64(ts):
    return [None if t is None else t.double() for t in ts]


# ---- the tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
def test_fused_mlp_small_m(s, dtype):
    args = make_inputs(s, dtype, seed=zlib.crc32(str(s).encode()))
    with poisoned_empty():
        y = fused_mlp_small_m(*args, s.act)
    x, wg, bg, wu, bu, wd, bd = _f64(args)
    ideal = F.linear(reference_gate_up(x, wg, bg, wu, bu, s.act).to(dtype).double(), wd, bd).to(dtype)
    check(y, reference_mlp(x, wg, bg, wu, bu, wd, bd, s.act), reference_mlp(*args, s.act), ideal, dtype)


def _pin_one_config(monkeypatch, s: Shape, dtype):
    """On the GPU, run one autotune config per case (each config in turn across the cases), not all of them:
    tuning every case would compile ~6 kernels per case. The interpreter has a single config anyway."""
    kernel = gemm._gate_up_act_kernel
    fits = gemm.tuning_configs(kernel.configs, dtype.itemsize, m_bucket(s.M))  # what the op tunes over
    monkeypatch.setattr(kernel, "configs", [fits[zlib.crc32(str(s).encode()) % len(fits)]])


def test_gate_up_configs_tuned_fit_in_shared_memory_and_suit_m(monkeypatch):
    """The GPU's config list, pruned per dtype and M bucket as the autotuner prunes it: every config tuned fits in
    shared memory and suits M. fp32 at M <= 16 fits none at its stages (a 128 x 128 x 64 fp32 tile asked
    288 KiB of 227), so those take fewer stages; fp16/bf16 keep the configs that fit as they are."""
    monkeypatch.setattr(gemm, "INTERPRET", False)
    configs = gemm._configs()
    assert len(configs) > 1
    for itemsize in (2, 4):
        for bucket in (1, 2, 8, 16, 32, 64, 128, 4096):
            tuned = gemm.tuning_configs(configs, itemsize, bucket)
            assert tuned, (itemsize, bucket)
            for c in tuned:
                k = c.kwargs
                assert common.k_loop_fits(c.num_stages, k["BLOCK_M"], k["BLOCK_K"], k["BLOCK_N"], 2, itemsize), c
                assert k["BLOCK_M"] <= max(32, 2 * bucket), (c, bucket)
            if itemsize == 2:
                assert tuned == [c for c in configs if gemm.config_fits(c, 2, bucket)]
    fp32_few = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]): c.num_stages
                for c in gemm.tuning_configs(configs, 4, 1)}
    assert fp32_few[16, 32, 128] == 5 and fp32_few[32, 64, 128] == 2  # 6 and 4 stages in the list (5: 200 KiB)
    assert (16, 64, 256) not in fp32_few  # 288 KiB at 2 stages


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
def test_gate_up_act(s, dtype, monkeypatch):
    _pin_one_config(monkeypatch, s, dtype)
    x, wg, bg, wu, bu, _, _ = make_inputs(s, dtype, seed=zlib.crc32(str(s).encode()))
    with poisoned_empty():
        h = gate_up_act(x, wg, bg, wu, bu, s.act)
    ref = reference_gate_up(*_f64((x, wg, bg, wu, bu)), s.act)
    check(h, ref, reference_gate_up(x, wg, bg, wu, bu, s.act), ref.to(dtype), dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
def test_gate_up_act_swapab(s, dtype):
    """The swap-AB gate/up kernel (weight rows in the dot's M side): its default blocks for the shape, then 16-row
    weight blocks (so I = 5 or 127 ends in a partial block whose clamped rows must not be stored), twice: the
    second call also zeroes a poisoned int32 workspace, as it does for linear_splitk's counters."""
    x, wg, bg, wu, bu, _, _ = make_inputs(s, dtype, seed=zlib.crc32(str(s).encode()) + 2)
    ref = reference_gate_up(*_f64((x, wg, bg, wu, bu)), s.act)
    for config in (None, (16, 16, 32, 4, 1)):
        with poisoned_empty():
            h = swapab.gate_up_act_swapab(x, wg, bg, wu, bu, s.act, config=config)
        check(h, ref, reference_gate_up(x, wg, bg, wu, bu, s.act), ref.to(dtype), dtype)
        zero = torch.full((300,), -7, dtype=torch.int32, device=x.device)  # more than one 256-wide store
        assert torch.equal(h, swapab.gate_up_act_swapab(x, wg, bg, wu, bu, s.act, zero=zero, config=config))
        assert not zero.any()


def test_swapab_config_picks_run_40s_fastest(monkeypatch):
    """The swap-AB blocks rule on an H200 (132 SMs, 228 KiB each; the bf16 sweep in NOTES): the fastest config of each
    row where it was (BLOCK_M, 64, BLOCK_K, 4 warps, stages); fp32 halves BLOCK_K and stays within 200 KiB."""
    monkeypatch.setattr(swapab, "INTERPRET", False)
    monkeypatch.setattr(common, "num_sms", lambda device: 132)
    monkeypatch.setattr(common, "smem_per_sm", lambda device: 228 * 1024)
    rule = swapab.swapab_config.__wrapped__  # not the cache: the patched machine
    cpu = torch.device("cpu")
    fastest = {  # N (= I), M -> (BLOCK_K, stages), measured fastest on the H200
        (11008, 1): (128, 3), (11008, 16): (128, 3), (11008, 32): (64, 4), (11008, 64): (64, 4),
        (18944, 32): (64, 3), (18944, 64): (64, 3), (14336, 1): (128, 3), (14336, 16): (128, 3),
        (3584, 1): (128, 4), (3584, 16): (128, 4), (3584, 32): (128, 4), (3584, 64): (128, 4),
    }
    for (N, M), (bk, stages) in fastest.items():
        assert rule(M, N, 2, cpu) == (max(16, m_bucket(M)), 64, bk, 4, stages), (N, M)
    bm, _, bk, _, stages = rule(64, 3584, 4, cpu)
    assert bk == 64 and gemm.k_loop_fits(stages, bm, bk, 64, 2, 4)
    # A plain MLP's program streams one weight (GELU+bias 4096x11008, bf16: BLOCK_K 128 with 4 stages was the
    # fastest of twelve configs at M = 1, 16 and 32; counting two weights picked 3 stages, or BLOCK_K 64, instead)
    for M in (1, 16, 32):
        assert rule(M, 11008, 2, cpu, 1) == (max(16, M), 64, 128, 4, 4), M


def test_swapab_counts_the_weights_it_loads(monkeypatch):
    """gate_up_act_swapab asks its config for the weights its program streams: two gated, one plain."""
    seen = []
    real = swapab.swapab_config

    def spy(*args):
        seen.append(args[4])
        return real(*args)

    monkeypatch.setattr(swapab, "swapab_config", spy)
    for gated in (True, False):
        s = Shape(3, 64, 40, 32, "gelu", gated, (False, False, False), "linear", "contiguous")
        x, wg, bg, wu, bu, _, _ = make_inputs(s, torch.float32, seed=11)
        swapab.gate_up_act_swapab(x, wg, bg, wu, bu, s.act)
    assert seen == [2, 1]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 17, 67])
def test_gate_up_act_autotuned(M, dtype):
    """The real autotuner (every config that fits, timed on the GPU), for one gated shape per M bucket."""
    s = Shape(M, 130, 127, 3, "silu", True, (True, True, False), "merged", "strided")
    x, wg, bg, wu, bu, _, _ = make_inputs(s, dtype, seed=5)
    h = gate_up_act(x, wg, bg, wu, bu, s.act)
    ref = reference_gate_up(*_f64((x, wg, bg, wu, bu)), s.act)
    check(h, ref, reference_gate_up(x, wg, bg, wu, bu, s.act), ref.to(dtype), dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("layout", ["strided", "contiguous"])  # the tiled kernel and the flat one
@pytest.mark.parametrize("act", ACTS)
def test_act_mul(act, gated, dtype, layout):
    gen = torch.Generator().manual_seed(7)
    g = (_rand(gen, 33, 2 * 131) * 2).to(dtype).to(KERNEL_DEVICE)[:, ::2]  # strided rows and columns
    u = _rand(gen, 131, 33).to(dtype).to(KERNEL_DEVICE).t() if gated else None  # column-major
    if layout == "contiguous":  # 33 x 131 = 4323 elements: a ragged last block
        g, u = g.contiguous(), None if u is None else u.contiguous()
    with poisoned_empty():
        h = act_mul(g, u, act)
    assert h.is_contiguous()
    fn = ACTIVATIONS[act].fn
    ref = fn(g.double()) * u.double() if gated else fn(g.double())
    check(h, ref, fn(g) * u if gated else fn(g), ref.to(dtype), dtype)


@pytest.mark.parametrize("act", ACTS)
def test_act_mul_matches_torch_fn_fp32(act):
    """Over the tails of every activation, act_mul in fp32 is as close to float64 as torch's fp32 ``fn(g) * u``:
    within 1.25 x torch's own error (+ 1e-6, as the op tests). torch's fp32 result differs between processors
    (its vectorised erf, say), so it is the measure of the bar, never the reference."""
    gen = torch.Generator().manual_seed(3)
    g = (_rand(gen, 5, 1000) * 4).float().to(KERNEL_DEVICE)  # covers the tails of every activation
    u = _rand(gen, 5, 1000).float().to(KERNEL_DEVICE)
    fn = ACTIVATIONS[act].fn
    cases = {"act": (act_mul(g, None, act), fn(g), fn(g.double())),
             "act*u": (act_mul(g, u, act), fn(g) * u, fn(g.double()) * u.double())}
    for name, (out, torch_out, ref) in cases.items():
        err, torch_err = rel_err(out, ref), rel_err(torch_out, ref)
        assert err <= 1.25 * torch_err + 1e-6, f"{name}: fp32 error {err:.3g} > 1.25 x torch's {torch_err:.3g} + 1e-6"


def _backward_reference(dy, wd, g, u, act):
    """(dgu, h) as mlp_backward defines them, computed in the inputs' dtype with torch ops."""
    f = ACTIVATIONS[act]
    dh = dy @ wd
    a, dg = f.fn(g), dh * f.grad(g)
    if u is None:
        return dg, a
    return torch.cat([dg * u, dh * a], 1), a * u


@pytest.mark.parametrize("impl", ["triton_backward_gemm", "cublas_backward_act"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
def test_mlp_backward(s, dtype, impl, monkeypatch):
    """dh = dy @ w_down with act' and the products after it (in the GEMM's epilogue, or in an elementwise pass after
    torch.mm), against float64: the weights of every layout, g and u as the two halves of one (M, 2I) GEMM output
    (a row stride of 2I) or transposed, dy as x is laid out."""
    kernel = backward._mlp_backward_kernel
    monkeypatch.setattr(kernel, "configs", [kernel.configs[zlib.crc32(str(s).encode()) % len(kernel.configs)]])
    x, wg, bg, wu, bu, wd, _ = make_inputs(s, dtype, seed=zlib.crc32(str(s).encode()))
    gen = torch.Generator().manual_seed(zlib.crc32(str(s).encode()) + 1)
    if s.x_layout == "transposed":
        dy = _rand(gen, s.O, s.M).to(dtype).to(KERNEL_DEVICE).t()
        g = (F.linear(x, wg, bg) * 2).t().contiguous().t()  # column-major
        u = F.linear(x, wu, bu).t().contiguous().t() if s.gated else None
    else:
        dy = _rand(gen, s.M, s.O).to(dtype).to(KERNEL_DEVICE)
        gu = torch.cat([F.linear(x, wg, bg) * 2, F.linear(x, wu, bu) if s.gated else x.new_empty(s.M, 0)], 1)
        g, u = gu[:, :s.I], (gu[:, s.I:] if s.gated else None)
    for need_h in (True, False):
        with poisoned_empty():
            dgu, h = BACKWARD_BY_NAME[impl].fn(dy, wd, g, u, s.act, need_h)
        ref_dgu, ref_h = _backward_reference(*_f64((dy, wd, g, u)), s.act)
        unf_dgu, unf_h = _backward_reference(dy, wd, g, u, s.act)
        assert dgu.is_contiguous() and dgu.shape == (s.M, 2 * s.I if s.gated else s.I)
        check(dgu, ref_dgu, unf_dgu, ref_dgu.to(dtype), dtype)
        if need_h:
            check(h, ref_h, unf_h, ref_h.to(dtype), dtype)
        else:
            assert h is None


def test_empty_m():
    x = torch.randn(0, 5, device=KERNEL_DEVICE)
    w, wd = torch.randn(7, 5, device=KERNEL_DEVICE), torch.randn(3, 7, device=KERNEL_DEVICE)
    assert fused_mlp_small_m(x, w, None, w, None, wd, None, "silu").shape == (0, 3)
    assert gate_up_act(x, w, None, w, None, "silu").shape == (0, 7)
    assert act_mul(torch.randn(0, 7, device=KERNEL_DEVICE), None, "gelu").shape == (0, 7)
    dgu, h = backward.mlp_backward(torch.randn(0, 3, device=KERNEL_DEVICE), wd, torch.randn(0, 7, device=KERNEL_DEVICE),
                                   torch.randn(0, 7, device=KERNEL_DEVICE), "silu", True)
    assert dgu.shape == (0, 14) and h.shape == (0, 7)
    g0 = torch.randn(0, 7, device=KERNEL_DEVICE)
    dgu, h = backward.act_mul_backward(torch.randn(0, 3, device=KERNEL_DEVICE), wd, g0, None, "gelu", False)
    assert dgu.shape == (0, 7) and h is None
