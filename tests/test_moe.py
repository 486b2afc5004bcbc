"""The routed-experts op ``mlp_fuser::moe_mlp`` on the CPU: values against a float64 loop written here, argument
errors, gradients, autocast, the fake kernel under torch.compile, opcheck, and the Triton paths under the interpreter.
"""

import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE, requires_cuda

import mlp_fuser
from mlp_fuser import config
from mlp_fuser.dispatch import core, experts

# The activations as written out here, independent of the package's registry (float64 in, float64 out).
ACTS = {
    "silu": lambda v: v * torch.sigmoid(v),
    "gelu": lambda v: 0.5 * v * (1.0 + torch.erf(v / math.sqrt(2.0))),
    "relu": lambda v: v.clamp(min=0),
    "quick_gelu": lambda v: v * torch.sigmoid(1.702 * v),
    "gelu_tanh": lambda v: 0.5 * v * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3))),
    "relu2": lambda v: v.clamp(min=0) ** 2,
}


def naive(x, ids, wts, wgu, bgu, wd, bd, act, interleaved=False, limit=None, clamp_after=False, up_offset=0.0):
    """y[t] = sum_j w[t,j] * expert_{ids[t,j]}(x[t]), one token and one pair at a time, in float64 (differentiable)."""
    E, H, I = wgu.shape[0], x.shape[-1], wd.shape[-1]
    gated = wgu.shape[1] == 2 * I
    lead = x.shape[:-1]
    x2, ids2, wts2 = x.reshape(-1, H).double(), ids.reshape(-1, ids.shape[-1]), wts.reshape(-1, ids.shape[-1]).double()
    wgu, wd = wgu.double(), wd.double()
    rows = []
    for t in range(x2.shape[0]):
        y = torch.zeros(H, dtype=torch.float64)
        for j in range(ids2.shape[1]):
            e = int(ids2[t, j])
            if e >= E:  # an expert-parallel sentinel: nothing
                continue
            h = wgu[e] @ x2[t]
            if bgu is not None:
                h = h + bgu[e].double()
            if gated:
                g, u = (h[0::2], h[1::2]) if interleaved else (h[:I], h[I:])
                if limit is not None and not clamp_after:
                    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                a = ACTS[act](g)
                if limit is not None and clamp_after:
                    a, u = a.clamp(max=limit), u.clamp(-limit, limit)
                h = a * (u + up_offset)
            else:
                h = ACTS[act](h)
            o = wd[e] @ h
            if bd is not None:
                o = o + bd[e].double()
            y = y + wts2[t, j] * o
        rows.append(y)
    out = torch.stack(rows) if rows else torch.zeros(0, H, dtype=torch.float64)
    return out.reshape(*lead, H)


def make(T, k, E, H=16, I=8, gated=True, biases=False, dtype=torch.float32, transposed=False, ids=None, lead=None):
    """Fresh random inputs (never zeros): x, ids, weights, w_gate_up, b_gate_up, w_down, b_down."""
    N = 2 * I if gated else I
    x = torch.randn(*(lead or (T,)), H, dtype=dtype)
    tokens = x.shape[:-1]
    if ids is None:
        n = math.prod(tokens)  # distinct experts per token where k <= E, as a router picks them
        ids = torch.rand(n, E).argsort(-1)[:, :k] if k <= E else torch.randint(0, E, (n, k))
        ids = ids.reshape(*tokens, k)
    wts = torch.rand(*tokens, k, dtype=dtype) + 0.1
    if transposed:  # GPT-OSS's storage: (E, H, 2I) and (E, I, H), passed as transposed views
        wgu = (torch.randn(E, H, N, dtype=dtype) / H**0.5).transpose(1, 2)
        wd = (torch.randn(E, I, H, dtype=dtype) / I**0.5).transpose(1, 2)
    else:
        wgu = torch.randn(E, N, H, dtype=dtype) / H**0.5
        wd = torch.randn(E, H, I, dtype=dtype) / I**0.5
    bgu = torch.randn(E, N, dtype=dtype) * 0.5 if biases else None
    bd = torch.randn(E, H, dtype=dtype) * 0.5 if biases else None
    return x, ids, wts, wgu, bgu, wd, bd


def on(args, device):
    """The case's tensors on ``device`` (the kernels' device: CPU tensors reach Triton only under the interpreter)."""
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def check(args, act="silu", atol=1e-5, rtol=1e-4, **kw):
    y = mlp_fuser.moe_mlp(*args, act, **kw)
    ref = naive(*args, act, **kw)
    assert y.shape == args[0].shape and y.dtype == args[0].dtype
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), ref, atol=atol, rtol=rtol)
    return y


# ---- 1. values --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [0, 1, 5, 33])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("E", [1, 8, 256])
def test_shapes(T, k, E):
    check(make(T, k, E, H=8, I=4))


@pytest.mark.parametrize("act", ["silu", "gelu", "relu", "quick_gelu", "gelu_tanh", "relu2"])
@pytest.mark.parametrize("gated", [True, False])
def test_activations_gated_and_plain(act, gated):
    check(make(9, 2, 4, gated=gated), act)


def test_duplicate_ids_and_idle_expert():
    E = 4
    ids = torch.tensor([[0, 0], [2, 2], [0, 2], [2, 0], [0, 0]])  # duplicates; experts 1 and 3 get no token
    args = make(5, 2, E, ids=ids)
    check(args)
    # an idle expert's weights do not matter
    wgu, wd = args[3].clone(), args[5].clone()
    wgu[1], wd[3] = float("nan"), float("nan")
    y = mlp_fuser.moe_mlp(args[0], ids, args[2], wgu, None, wd, None, "silu")
    torch.testing.assert_close(y.double(), naive(*args, "silu"), atol=1e-5, rtol=1e-4)


def test_every_token_one_expert():
    check(make(17, 1, 8, ids=torch.full((17, 1), 5)))
    check(make(17, 2, 8, ids=torch.full((17, 2), 3)))


def test_sentinels_contribute_nothing():
    E = 4
    ids = torch.tensor([[0, 4], [7, 1], [4, 4], [2, 3], [100, 0]])  # ids >= E: expert-parallel sentinels
    args = make(5, 2, E, ids=ids, biases=True)
    y = check(args)
    assert torch.equal(y[2], torch.zeros_like(y[2]))  # both pairs sentinels: exactly zero, biases included
    # the same as dropping the sentinel pairs' weights to zero on real experts
    ids0 = ids.clamp(max=E - 1)
    wts0 = args[2].masked_fill(ids >= E, 0.0)
    y0 = mlp_fuser.moe_mlp(args[0], ids0, wts0, *args[3:], "silu")
    torch.testing.assert_close(y, y0, atol=1e-6, rtol=1e-5)


def test_all_sentinels():
    args = make(4, 2, 4, ids=torch.full((4, 2), 4))
    y = mlp_fuser.moe_mlp(*args, "silu")
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("biases", [False, True])
def test_layouts_and_biases(interleaved, biases):
    check(make(11, 2, 4, biases=biases), interleaved=interleaved)


def test_interleaved_is_not_concatenated():
    args = make(6, 2, 4)
    a = mlp_fuser.moe_mlp(*args, "silu", interleaved=True)
    b = mlp_fuser.moe_mlp(*args, "silu", interleaved=False)
    assert not torch.allclose(a, b, atol=1e-3)


def test_gpt_oss_activation():
    """quick_gelu, gate and up clamped at 7, (up + 1), interleaved, biases, transposed storage; inputs large enough
    that the clamps bind."""
    args = list(make(13, 2, 4, H=16, I=8, biases=True, transposed=True))
    args[0] = args[0] * 8.0
    x, ids, wts, wgu, bgu, wd, bd = args
    h = torch.einsum("th,enh->ten", x, wgu)
    assert (h > 7).any() and (h < -7).any()  # the clamp binds somewhere
    check(args, "quick_gelu", interleaved=True, limit=7.0, up_offset=1.0, atol=1e-4)


@pytest.mark.parametrize("clamp_after", [False, True])
def test_clamped_silu(clamp_after):
    args = list(make(13, 2, 4))
    args[0] = args[0] * 6.0
    check(args, "silu", limit=2.0, clamp_after=clamp_after, atol=1e-4)


def test_clamp_before_differs_from_after():
    args = list(make(13, 2, 4))
    args[0] = args[0] * 6.0
    a = mlp_fuser.moe_mlp(*args, "silu", limit=2.0, clamp_after=False)
    b = mlp_fuser.moe_mlp(*args, "silu", limit=2.0, clamp_after=True)
    assert not torch.allclose(a, b, atol=1e-3)


def test_transposed_views():
    args = make(9, 2, 4, biases=True, transposed=True)
    assert not args[3].is_contiguous() and not args[5].is_contiguous()
    check(args)


def test_leading_dims():
    args = make(0, 2, 4, lead=(2, 3, 5))
    y = check(args)
    assert y.shape == (2, 3, 5, 16)


def test_fp64_and_fp16():
    check(make(7, 2, 4, dtype=torch.float64), atol=1e-12, rtol=1e-10)
    check(make(7, 2, 4, dtype=torch.float16), atol=2e-2, rtol=2e-2)


def test_int32_ids():
    args = list(make(7, 2, 4))
    args[1] = args[1].int()
    check(args)


# ---- 2. errors ------------------------------------------------------------------------------------------------


def _bad(args, i, value):
    a = list(args)
    a[i] = value
    return a


@pytest.mark.parametrize("i, value, exc, name", [
    (0, torch.randn(5, 15), ValueError, "x"),  # hidden size
    (0, torch.randint(0, 3, (5, 16)), TypeError, "x has dtype"),
    (1, torch.zeros(5, 3, dtype=torch.long), ValueError, "topk_weights"),  # k differs from the weights'
    (1, torch.zeros(4, 2, dtype=torch.long), ValueError, "topk_ids"),
    (1, torch.zeros(5, 2), TypeError, "topk_ids"),
    (2, torch.rand(5, 3), ValueError, "topk_weights"),
    (2, torch.ones(5, 2, dtype=torch.long), TypeError, "topk_weights"),
    (3, torch.randn(4, 12, 16), ValueError, "w_gate_up"),  # 12 rows: neither I nor 2I
    (3, torch.randn(4, 16, 15), ValueError, "w_gate_up"),
    (3, torch.randn(16, 16), ValueError, "w_gate_up"),
    (3, torch.randint(0, 3, (4, 16, 16)), TypeError, "w_gate_up"),
    (3, torch.randn(4, 16, 16, dtype=torch.float64), TypeError, "w_gate_up"),
    (4, torch.randn(4, 15), ValueError, "b_gate_up"),
    (4, torch.randn(4, 16, dtype=torch.float16), TypeError, "b_gate_up"),
    (5, torch.randn(3, 16, 8), ValueError, "w_down"),
    (5, torch.randn(4, 15, 8), ValueError, "w_down"),
    (5, torch.randn(4, 16), ValueError, "w_down"),
    (5, torch.randint(0, 3, (4, 16, 8)), TypeError, "w_down"),
    (6, torch.randn(4, 15), ValueError, "b_down"),
    (6, torch.randn(3, 16), ValueError, "b_down"),
])
def test_bad_arguments(i, value, exc, name):
    args = _bad(make(5, 2, 4, biases=True), i, value)
    with pytest.raises(exc, match=name):
        mlp_fuser.moe_mlp(*args, "silu")


def test_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        mlp_fuser.moe_mlp(*make(5, 2, 4), "tanhshrink")


def test_negative_ids():
    args = _bad(make(5, 2, 4), 1, torch.tensor([[0, 1], [2, -1], [0, 1], [1, 2], [3, 0]]))
    with pytest.raises(ValueError, match="topk_ids holds -1"):
        mlp_fuser.moe_mlp(*args, "silu")


def test_mismatched_device():
    args = _bad(make(5, 2, 4), 2, torch.rand(5, 2, device="meta"))
    with pytest.raises(ValueError, match="topk_weights is on meta"):
        mlp_fuser.moe_mlp(*args, "silu")


def test_errors_under_grad_and_fake():
    args = _bad(make(5, 2, 4), 5, torch.randn(3, 16, 8))
    args[0].requires_grad_(True)
    with pytest.raises(ValueError, match="w_down"):
        mlp_fuser.moe_mlp(*args, "silu")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(ValueError, match="w_down"):
            mlp_fuser.moe_mlp(*fake, "silu")


# ---- 3. gradients ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["concat", "plain", "gpt_oss", "sentinels"])
def test_gradients(case):
    kw, act = {}, "silu"
    ids = None
    if case == "sentinels":
        ids = torch.tensor([[0, 4], [9, 1], [4, 4], [2, 3], [3, 0], [1, 1]])
    args = list(make(6, 2, 4, gated=case != "plain", biases=True, transposed=case == "gpt_oss", ids=ids))
    if case == "gpt_oss":
        args[0] = args[0] * 4.0
        kw, act = dict(interleaved=True, limit=7.0, up_offset=1.0), "quick_gelu"
    names = ["x", "topk_weights", "w_gate_up", "b_gate_up", "w_down", "b_down"]
    idx = [0, 2, 3, 4, 5, 6]
    leaves = [args[i].detach().clone().requires_grad_(True) for i in idx]
    leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
    a32, a64 = list(args), list(args)
    for i, t, t64 in zip(idx, leaves, leaves64):
        a32[i], a64[i] = t, t64
    y = mlp_fuser.moe_mlp(*a32, act, **kw)
    y64 = naive(*a64, act, **kw)
    dy = torch.randn_like(y64)
    y.backward(dy.float())
    y64.backward(dy)
    for name, t, t64 in zip(names, leaves, leaves64):
        assert t.grad is not None, name
        torch.testing.assert_close(t.grad.double(), t64.grad, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    if case == "sentinels":  # a token whose pairs are all sentinels gets no gradient
        assert torch.equal(leaves[0].grad[2], torch.zeros(16))
        assert torch.equal(leaves[1].grad[2], torch.zeros(2))


def test_gradcheck_float64():
    args = list(make(4, 2, 3, H=4, I=3, biases=True, dtype=torch.float64))
    for i in (0, 2, 3, 4, 5, 6):
        args[i] = args[i].requires_grad_(True)

    def f(x, w, wgu, bgu, wd, bd):
        return mlp_fuser.moe_mlp(x, args[1], w, wgu, bgu, wd, bd, "gelu")

    assert torch.autograd.gradcheck(f, [args[i] for i in (0, 2, 3, 4, 5, 6)])


# ---- 4. autocast, fake kernel / compile, opcheck ---------------------------------------------------------------


def test_autocast_cpu_bf16():
    args = make(7, 2, 4, biases=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp_fuser.moe_mlp(*args, "silu")
        lin = F.linear(args[0], args[3][0])
    assert y.dtype == lin.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), naive(*args, "silu"), atol=5e-2, rtol=5e-2)


def test_compile_fullgraph_holds_the_op():
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x, ids, wts, wgu, wd):
        return mlp_fuser.moe_mlp(x * 2.0, ids, wts, wgu, None, wd, None, "silu") + 1.0

    args = make(6, 2, 4)
    torch._dynamo.reset()
    cf = torch.compile(f, backend=recording, fullgraph=True)
    y = cf(args[0], args[1], args[2], args[3], args[5])
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.mlp_fuser.moe_mlp.default in targets
    ref = naive(args[0] * 2.0, *args[1:], "silu") + 1.0
    assert y.shape == (6, 16)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-4)


def test_compile_inductor():
    def f(x, ids, wts, wgu, wd):
        return mlp_fuser.moe_mlp(x, ids, wts, wgu, None, wd, None, "gelu")

    args = make(6, 2, 4)
    torch._dynamo.reset()
    y = torch.compile(f, fullgraph=True)(args[0], args[1], args[2], args[3], args[5])
    torch.testing.assert_close(y.double(), naive(*args, "gelu"), atol=1e-5, rtol=1e-4)


def test_compile_training_aot():
    """Gradients through a compiled graph: the autograd kernel is traced with fake tensors (no host reads)."""
    args = make(6, 2, 4, biases=True)
    leaves = [args[i].clone().requires_grad_(True) for i in (0, 3, 5)]

    def f(x, ids, wts, wgu, bgu, wd, bd):
        return mlp_fuser.moe_mlp(x, ids, wts, wgu, bgu, wd, bd, "silu")

    torch._dynamo.reset()
    y = torch.compile(f, backend="aot_eager", fullgraph=True)(leaves[0], args[1], args[2], leaves[1], args[4],
                                                              leaves[2], args[6])
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = [t.detach().double().requires_grad_(True) for t in leaves]
    y64 = naive(ref[0], args[1], args[2], ref[1], args[4], ref[2], args[6], "silu")
    y64.backward(dy.double())
    torch.testing.assert_close(y.double(), y64, atol=1e-5, rtol=1e-4)
    for t, r in zip(leaves, ref):
        torch.testing.assert_close(t.grad.double(), r.grad, atol=1e-4, rtol=1e-4)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = make(0, 2, 4, lead=(2, 3), biases=True)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        y = mlp_fuser.moe_mlp(*fake, "silu")
    assert y.shape == (2, 3, 16) and y.dtype == torch.float32


@pytest.mark.parametrize("biases", [False, True])
def test_opcheck(biases):
    args = make(5, 2, 4, biases=biases)
    torch.library.opcheck(torch.ops.mlp_fuser.moe_mlp.default, (*args, "silu"))
    x, ids, wts, wgu, bgu, wd, bd = args
    grads = (x.clone().requires_grad_(True), ids, wts.clone().requires_grad_(True), wgu.clone().requires_grad_(True),
             bgu, wd.clone().requires_grad_(True), bd)
    torch.library.opcheck(torch.ops.mlp_fuser.moe_mlp.default, (*grads, "silu", True, 7.0, False, 1.0))


# ---- 5. the Triton implementations, under the interpreter ---------------------------------------------------------

TRITON = [i.name for i in experts.IMPLS if i.triton]


@pytest.fixture
def triton_impl(monkeypatch, request):
    from mlp_fuser.ops import moe

    monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(config, "force_impl", request.param)
    moe.reset()
    yield request.param
    moe.reset()


@pytest.mark.parametrize("triton_impl", TRITON, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["concat", "gpt_oss", "plain_sentinels"])
def test_triton(triton_impl, dtype, case):
    from conftest import poisoned_empty

    kw, act, ids = {}, "silu", None
    T, k, E = (5, 2, 4) if triton_impl == "triton_moe_pairs" else (19, 2, 8)
    if case == "plain_sentinels":
        ids = torch.randint(0, E + 2, (T, k))  # some ids are sentinels
        ids[0] = E  # a token with no expert
        ids[1, 0], ids[2, 1] = 2**31 - 1, 40  # sentinels past the sorting program's 16 histogram bins
        act = "gelu_tanh"
    args = list(make(T, k, E, H=32, I=16, gated=case != "plain_sentinels", biases=case == "gpt_oss",
                     transposed=case == "gpt_oss", dtype=dtype, ids=ids))
    if case == "gpt_oss":
        args[0] = args[0] * 4.0
        kw, act = dict(interleaved=True, limit=7.0, up_offset=1.0), "quick_gelu"
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    from conftest import KERNEL_DEVICE  # the interpreter's CPU here, the GPU there

    args = [a.to(KERNEL_DEVICE) if a is not None else None for a in args]
    reason = experts.IMPLS_BY_NAME[triton_impl].why_not(_problem(args, act, kw))
    if reason is not None:  # forced onto a layout it cannot read (TMA, interleaved rows): an error naming why
        with pytest.raises(ValueError, match=f"{triton_impl}.*{re.escape(reason)}"):
            mlp_fuser.moe_mlp(*args, act, **kw)
        assert triton_impl == "triton_moe_sorted_tma" and case == "gpt_oss"
        return
    with poisoned_empty():
        y = mlp_fuser.moe_mlp(*args, act, **kw)
        cpu = [a.cpu() if a is not None else None for a in args]
        torch.testing.assert_close(y.cpu().double(), naive(*cpu, act, **kw), **tol)
    assert experts.chosen(_problem(args, act, kw)) == triton_impl


def _problem(args, act, kw):
    from mlp_fuser.ops import moe

    x, ids, _, wgu, bgu, wd, bd = args
    gate = moe._gate(wgu, wd, act, kw.get("interleaved", False), kw.get("limit"), False, kw.get("up_offset", 0.0))
    return experts.Problem(x.device.type, x.dtype, x.shape[0], ids.shape[1], wgu.shape[0], x.shape[1], wd.shape[2],
                           gate, bgu is not None)


def test_tma_path_timed_only_when_asked_and_where_measured(monkeypatch):
    """triton_moe_sorted_tma is a candidate from 512 rows per expert, or with MLP_FUSER_MOE_TMA=1 from 97, on weights
    whose gate and up rows are not interleaved; the setting is part of the choice's key and of the call's signature."""
    from mlp_fuser.kernels import moe as kmoe
    from mlp_fuser.ops import moe

    monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(kmoe, "INTERPRET", True)  # a CPU problem passes the Hopper check on a GPU machine too
    assert not config.moe_tma or os.environ.get("MLP_FUSER_MOE_TMA") == "1"  # off by default

    def names(T, interleaved=False):
        gate = moe.Gate("silu", True, interleaved)
        return [i.name for i in experts.eligible(experts.Problem("cpu", torch.bfloat16, T, 8, 128, 2048, 768, gate,
                                                                  False))]

    monkeypatch.setattr(config, "moe_tma", False)
    key = experts._choice_key(experts.Problem("cpu", torch.bfloat16, 2048, 8, 128, 2048, 768, moe.Gate("silu"), False))
    sig = moe._signature(*make(4, 2, 4), "silu", False, None, False, 0.0)
    assert "triton_moe_sorted_tma" not in names(2048)  # 128 rows per expert: the host's cost may bound a prefill
    assert "triton_moe_sorted_tma" not in names(8191)  # 511.9
    assert "triton_moe_sorted_tma" in names(8192)  # 512
    assert "triton_moe_sorted_tma" not in names(8192, interleaved=True)
    monkeypatch.setattr(config, "moe_tma", True)
    assert "triton_moe_sorted_tma" in names(2048) and "triton_moe_sorted" in names(2048)
    assert "triton_moe_sorted_tma" not in names(64)  # 4 rows per expert
    assert "triton_moe_sorted_tma" not in names(2048, interleaved=True)
    assert key != experts._choice_key(experts.Problem("cpu", torch.bfloat16, 2048, 8, 128, 2048, 768, moe.Gate("silu"),
                                                      False))
    assert sig != moe._signature(*make(4, 2, 4), "silu", False, None, False, 0.0)


def test_triton_needs_opt_in(monkeypatch):
    """Forced onto CPU tensors without triton_on_cpu: a clear error, not a crash inside Triton."""
    monkeypatch.setattr(config, "triton_on_cpu", False)
    monkeypatch.setattr(config, "force_impl", "triton_moe_sorted")
    mlp_fuser.ops.moe.reset()
    with pytest.raises(ValueError, match="triton_moe_sorted"):
        mlp_fuser.moe_mlp(*make(5, 2, 4), "silu")
    mlp_fuser.ops.moe.reset()


def test_choice_for_plain_calls_and_for_graph_captures(monkeypatch):
    """A call captured in a CUDA graph takes the implementation fastest on the GPU alone; other calls the one
    fastest with the host's time (at one token they differ: fewer launches against less GPU time)."""
    from mlp_fuser.ops import moe

    x, ids, wts, wgu, bgu, wd, bd = make(3, 2, 4)
    gate = moe._gate(wgu, wd, "silu", False, None, False, 0.0)
    p = experts.Problem("cuda", x.dtype, 3, 2, 4, x.shape[1], wd.shape[2], gate, False)
    plain, graph = experts.IMPLS_BY_NAME["triton_moe_pairs"], experts.IMPLS_BY_NAME["triton_moe_sorted"]
    moe.reset()
    monkeypatch.setattr(core, "time_candidates", lambda reg, candidates, args, p: (graph.name, plain.name))
    monkeypatch.setattr(core, "candidates", lambda reg, p: [plain, graph])
    for capturing, expected in ((False, plain), (True, graph), (False, plain)):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
        assert experts.choose(p, ()) is expected
    assert experts.chosen(p) == "triton_moe_pairs (graphs: triton_moe_sorted)"
    moe.reset()


def test_eager_entry_skips_the_dispatcher_only_where_nothing_needs_it(monkeypatch):
    """eager_moe_mlp computes plain calls right away (the same result as the registered op) and hands calls with
    gradients, autocast or a dispatch mode to the registered op."""
    from mlp_fuser import compat
    from mlp_fuser.ops import moe

    if not compat.PRIVATE:
        pytest.skip("the public path never skips the dispatcher")  # the CPU and GPU machines take the private path
    args = make(5, 2, 4)
    direct = []
    real = moe._forward
    monkeypatch.setattr(moe, "_forward", lambda *a, **k: direct.append(1) or real(*a, **k))
    y = moe.eager_moe_mlp(*args, "silu")
    assert direct == [1]
    torch.testing.assert_close(y, torch.ops.mlp_fuser.moe_mlp.default(*args, "silu"), rtol=0, atol=0)
    x, *rest = args
    direct.clear()
    moe.eager_moe_mlp(x.clone().requires_grad_(True), *rest, "silu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe.eager_moe_mlp(*args, "silu")
    assert direct == []  # both through the registered op (whose kernel is the _forward registered at import)


# ---- 6. the per-signature entries of plain calls ---------------------------------------------------------------


def _calls(*args, act="silu", **kw):
    """The op through its eager entry and through the dispatcher."""
    from mlp_fuser.ops import moe

    return [lambda: moe.eager_moe_mlp(*args, act, **kw), lambda: mlp_fuser.moe_mlp(*args, act, **kw)]


def test_bad_calls_after_good_ones_still_raise():
    """A call that breaks a rule raises its named error on its first and every later call, after good calls of the
    same shapes and of others (the cache of plain calls never admits it)."""
    from mlp_fuser.ops import moe

    moe.reset()
    x, ids, *rest = make(5, 2, 4)
    args = (x, ids.contiguous(), *rest)  # so that the ids below, with a negative one, have the same signature
    for good in (args, make(3, 2, 4, H=32), args):
        for call in _calls(*good):
            call()
    x, ids, wts, wgu, bgu, wd, bd = args
    neg = ids.clone()
    neg[1, 0] = -1
    bad = [
        ((x.to(torch.int32), ids, wts, wgu, bgu, wd, bd), {}, TypeError, "x has dtype"),
        ((x, ids.float(), wts, wgu, bgu, wd, bd), {}, TypeError, "topk_ids"),
        ((x, ids, wts.to(torch.int64), wgu, bgu, wd, bd), {}, TypeError, "topk_weights"),
        ((x, ids, wts, wgu.double(), bgu, wd, bd), {}, TypeError, "w_gate_up"),
        ((x, ids, wts, wgu, bgu, torch.randn(4, 17, 8), bd), {}, ValueError, "w_down"),
        ((x, ids[:, :1], wts, wgu, bgu, wd, bd), {}, ValueError, "topk_weights"),
        ((x, ids, wts, wgu, torch.randn(4, 3), wd, bd), {}, ValueError, "b_gate_up"),
        ((x, neg, wts, wgu, bgu, wd, bd), {}, ValueError, "topk_ids holds -1"),
        ((x, ids, wts, wgu, bgu, wd, bd), {"act": "no_such_act"}, ValueError, "activation"),
    ]
    for bad_args, kw, exc, msg in bad:
        for _ in range(2):
            for call in _calls(*bad_args, **kw):
                with pytest.raises(exc, match=msg):
                    call()
    for call in _calls(*args):  # the good signature still runs
        torch.testing.assert_close(call().double(), naive(*args, "silu"), atol=1e-5, rtol=1e-4)
    moe.reset()


def test_cache_misses_on_a_changed_config(monkeypatch):
    """The settings are part of a call's signature: forcing another implementation, turning Triton on CPU tensors
    off, or autotuning off takes the full path again (which raises where the forced implementation cannot run)."""
    from mlp_fuser.kernels import common
    from mlp_fuser.kernels import moe as kmoe
    from mlp_fuser.ops import moe

    launches = []
    real = kmoe.launch
    count = lambda *a, **kw: launches.append(a[0]) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(kmoe, "launch", count)
    monkeypatch.setattr(common, "launch", count)  # a plan's Prepared launches
    monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(config, "force_impl", "triton_moe_pairs")
    moe.reset()
    cpu_args = make(3, 2, 4, H=32, I=16)
    args, ref = on(cpu_args, KERNEL_DEVICE), naive(*cpu_args, "silu")
    for _ in range(2):
        torch.testing.assert_close(moe.eager_moe_mlp(*args, "silu").double().cpu(), ref, atol=1e-5, rtol=1e-4)
    assert len(launches) == 4 and len(moe._EAGER) == 1
    if KERNEL_DEVICE == "cpu":  # the switch governs CPU tensors only
        monkeypatch.setattr(config, "triton_on_cpu", False)
        for _ in range(2):
            with pytest.raises(ValueError, match="triton_moe_pairs"):
                moe.eager_moe_mlp(*args, "silu")
    monkeypatch.setattr(config, "force_impl", "reference")
    for _ in range(2):
        torch.testing.assert_close(moe.eager_moe_mlp(*args, "silu").double().cpu(), ref, atol=1e-5, rtol=1e-4)
    assert len(launches) == 4  # the reference launches no Triton kernel
    monkeypatch.setattr(config, "autotune", not config.autotune)
    moe.eager_moe_mlp(*args, "silu")
    assert len(moe._EAGER) == 3
    moe.reset()
    assert not moe._EAGER


@pytest.mark.parametrize("impl", TRITON + ["reference"])
def test_cached_calls_equal_the_full_path(impl, monkeypatch):
    """Later calls of a signature (fresh values each time) give what the full path gives, bit for bit; a call that
    differs only in its weights' strides, or in its leading dimensions, is a signature of its own."""
    from conftest import poisoned_empty

    from mlp_fuser.ops import moe

    monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(config, "force_impl", impl)
    moe.reset()
    gpt_oss = dict(interleaved=True, limit=7.0, up_offset=1.0)
    def w_gate_up_transposed(args):  # only w_gate_up's strides differ from the case before
        x, ids, wts, wgu, *rest = args
        return (x, ids, wts, wgu.transpose(1, 2).contiguous().transpose(1, 2), *rest)

    cases = [(dict(lead=(2, 2)), "silu", {}), (dict(biases=True), "quick_gelu", gpt_oss),
             (dict(biases=True, change=w_gate_up_transposed), "quick_gelu", gpt_oss),
             (dict(biases=True, transposed=True), "quick_gelu", gpt_oss), (dict(gated=False), "gelu_tanh", {})]
    if impl == "triton_moe_sorted_tma":  # interleaved gate and up rows are no TMA boxes: forcing it is an error
        with pytest.raises(ValueError, match="interleaved"):
            moe.eager_moe_mlp(*on(make(4, 2, 4, H=32, I=16, biases=True), KERNEL_DEVICE), "quick_gelu", **gpt_oss)
        cases = [c for c in cases if not c[2]]
    with poisoned_empty():
        for i, (make_kw, act, kw) in enumerate(cases):
            for _ in range(2):
                make_kw = dict(make_kw)
                change = make_kw.pop("change", lambda args: args)
                cpu_args = change(make(4, 2, 4, H=32, I=16, **make_kw))
                args = on(cpu_args, KERNEL_DEVICE)
                y = moe.eager_moe_mlp(*args, act, **kw)
                assert len(moe._EAGER) == i + 1
                full = moe._forward_full(None, *args, act, kw.get("interleaved", False), kw.get("limit"), False,
                                         kw.get("up_offset", 0.0))
                torch.testing.assert_close(y, full, atol=0, rtol=0)
                torch.testing.assert_close(y.double().cpu(), naive(*cpu_args, act, **kw), atol=1e-4, rtol=1e-4)
    moe.reset()


@pytest.mark.parametrize("path, n_launches", [
    ("pairs", 2), ("unsorted", 2), ("unsorted_nomemset", 2), ("unsorted_pdl", 2), ("sorted", 4), ("sorted_fused", 3),
    ("sorted_fused_nomemset", 3), ("sorted_fused_pdl", 3), ("sorted_tma", 4)])
def test_plan_launches_what_moe_experts_launches(monkeypatch, path, n_launches):
    """``experts_plan``'s function hands the kernels (the routing's too) the very arguments ``moe_experts`` does: the
    inputs where they were, every buffer in the same place with its shape, strides, dtype and (ints) contents."""
    from conftest import poisoned_empty

    from mlp_fuser.kernels import common, moe_routing
    from mlp_fuser.kernels import moe as kmoe

    def record(fn, *args):
        seen, inputs, buffers, alive = [], {id(a): i for i, a in enumerate(args) if a is not None}, {}, []

        def describe(t):
            if id(t) in inputs:
                return "input", inputs[id(t)]
            if isinstance(t, kmoe.TensorDescriptor):  # over an input's memory, with its boxes
                base = next(i for i, a in enumerate(args) if a is not None and a.data_ptr() == t.base.data_ptr())
                return "descriptor", base, tuple(t.shape), tuple(t.strides), tuple(t.block_shape)
            if not isinstance(t, torch.Tensor):
                return t
            alive.append(t)  # kept until the call ends, so that no buffer's address is reused
            place = buffers.setdefault(t.data_ptr(), len(buffers))
            return place, tuple(t.shape), t.stride(), t.dtype, None if t.is_floating_point() else t.tolist()

        def rec(kernel, grid, *a, **kw):
            seen.append((kernel, tuple(grid), [describe(t) for t in a], kw))
        monkeypatch.setattr(kmoe, "launch", rec)
        monkeypatch.setattr(moe_routing, "launch", rec)
        monkeypatch.setattr(common, "launch", rec)  # what a plan's Prepared launches call
        with poisoned_empty():  # empty buffers hold a fill, zeroed ones zeros: the contents compare
            fn(*args)
        return seen

    for make_kw, act, inter in ((dict(), kmoe.ExpertAct(), False),
                                (dict(biases=True, transposed=True), kmoe.ExpertAct("quick_gelu", 0.0, 7.0, False, 1.0),
                                 True), (dict(gated=False, biases=True), kmoe.ExpertAct("gelu"), False)):
        for T in (3, 520) if path == "sorted" else (3,):  # 520 · 2 pairs: sorted by atomics (three launches)
            args = on(make(T, 2, 4, H=32, I=16, **make_kw), KERNEL_DEVICE)  # where the routing's kernels run too
            plan = kmoe.experts_plan(*args, act, inter, path)
            expected = record(lambda *a, act=act, inter=inter: kmoe.moe_experts(*a, act, inter, path), *args)
            assert len(expected) == n_launches + (2 if T > 3 else 0) and record(plan, *args) == expected


@requires_cuda
def test_cached_calls_take_the_graph_choice_while_capturing(monkeypatch):
    """A signature's later calls run the choice for plain calls, and the one for CUDA graphs while capturing."""
    from mlp_fuser.ops import moe

    ran = []

    def spy(name):
        return core.Impl(name, lambda *a: ran.append(name) or moe.reference(*a), None, experts.FLOAT)

    plain, graph = spy("plain"), spy("graph")
    monkeypatch.setattr(config, "force_impl", None)
    monkeypatch.setattr(config, "autotune", True)
    monkeypatch.setattr(core, "candidates", lambda reg, p: [plain, graph])
    monkeypatch.setattr(core, "time_candidates", lambda reg, candidates, args, p: ("graph", "plain"))
    moe.reset()
    args = [a.cuda() if a is not None else None for a in make(3, 2, 4)]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    moe.eager_moe_mlp(*args, "silu")  # captured before any choice: the aten path, and no entry kept
    assert ran == [] and not moe._EAGER
    for capturing, expected in ((False, "plain"), (False, "plain"), (True, "graph"), (False, "plain")):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
        ran.clear()
        moe.eager_moe_mlp(*args, "silu")
        assert ran == [expected]
    moe.reset()
