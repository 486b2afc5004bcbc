"""The routed experts' Triton backward (mlp_fuser.kernels.moe_backward) against float64 autograd through the aten
reference (mlp_fuser.ops.moe.reference), every gradient, on every layout it supports."""

import pytest
import torch
from _moe_cases import expert_tensors, sentinels, stored_transposed
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, poisoned_empty

from mlp_fuser.kernels.moe import ExpertAct
from mlp_fuser.kernels.moe_backward import moe_backward, moe_experts_autograd
from mlp_fuser.kernels.moe_routing import moe_align
from mlp_fuser.ops.moe import Gate, reference
from mlp_fuser.reference import rel_err

NAMES = ("dx", "dwts", "dw_gu", "db_gu", "dw_d", "db_d")


def make_case(T, k, E, H, I, dtype, gated=True, bias=False, transposed=False, empty_expert=True, seed=0,
              device=KERNEL_DEVICE):
    """Fresh random inputs; about 15% sentinel ids (>= E, every kind); no tokens for the last expert with
    ``empty_expert``."""
    gen = torch.Generator().manual_seed(seed)
    x, w_gu, b_gu, w_d, b_d = expert_tensors(gen, T, E, H, I, gated, bias)
    ids = torch.randint(0, E - 1 if empty_expert else E, (T, k), generator=gen)
    ids = torch.where(torch.rand((T, k), generator=gen) < 0.15, sentinels(gen, (T, k), E), ids)
    wts = torch.rand((T, k), generator=gen)
    dy = torch.randn((T, H), generator=gen)
    x, w_gu, b_gu, w_d, b_d, dy = (t.to(dtype) if t is not None else None for t in (x, w_gu, b_gu, w_d, b_d, dy))
    if transposed:
        w_gu, w_d = stored_transposed(w_gu, w_d)
    return [t.to(device) if t is not None else None for t in (x, ids, wts.to(dtype), w_gu, b_gu, w_d, b_d, dy)]


def grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy):
    """Every gradient by float64 autograd through the aten reference (zeros where autograd gives none)."""
    leaves = [t.detach().cpu().double().requires_grad_() if t is not None else None
              for t in (x, wts, w_gu, b_gu, w_d, b_d)]
    xx, ww, wgu, bgu, wd, bd = leaves
    y = reference(xx, ids.cpu(), ww, wgu, bgu, wd, bd, gate)
    y.backward(dy.cpu().double())
    g = [None if t is None else (t.grad if t.grad is not None else torch.zeros_like(t)) for t in leaves]
    return g[0], g[1], g[2], g[3], g[4], g[5]


def check(out, ref, bar):
    for name, o, r in zip(NAMES, out, ref):
        if r is None:
            assert o is None, name
            continue
        assert o.shape == r.shape, name
        err = rel_err(o.cpu(), r)
        assert err <= bar, f"{name}: relative error {err:.2e} > {bar:.0e}"


BAR = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}

CASES = {  # T, k, E, H, I, ExpertAct, the reference's Gate, gated, interleaved, bias, transposed
    "silu_concat": (37, 4, 8, 40, 24, ExpertAct("silu"), Gate("silu"), True, False, False, False),
    "gelu_interleaved_bias_transposed": (29, 2, 5, 33, 40, ExpertAct("gelu"), Gate("gelu", interleaved=True),
                                         True, True, True, True),
    "plain_gelu_bias": (23, 3, 4, 36, 20, ExpertAct("gelu"), Gate("gelu", gated=False), False, False, True, False),
    "gpt_oss_clamped": (25, 4, 6, 24, 36, ExpertAct(alpha=1.702, limit=0.75, up_offset=1.0),
                        Gate("quick_gelu", interleaved=True, limit=0.75, up_offset=1.0), True, True, True, True),
    "silu_clamp_after": (20, 2, 4, 40, 18, ExpertAct("silu", limit=0.3, clamp_after=True),
                         Gate("silu", limit=0.3, clamp_after=True), True, False, False, False),
    "one_token_many_experts": (1, 1, 16, 40, 24, ExpertAct("silu"), Gate("silu"), True, False, False, False),
}


# Every case in fp32; in 16 bits every case on the GPU, two under the interpreter (its runs are slow).
DTYPE_CASES = [(n, dt) for dt in KERNEL_DTYPES for n in CASES
               if dt == torch.float32 or KERNEL_DEVICE == "cuda" or n in ("silu_concat", "gpt_oss_clamped")]


@pytest.mark.parametrize(("name", "dtype"), DTYPE_CASES, ids=[f"{n}-{dt}" for n, dt in DTYPE_CASES])
def test_backward_matches_float64_autograd(name, dtype):
    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES[name]
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, H, I, dtype, gated, bias, transposed)
    with poisoned_empty():
        out = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy)
    check(out, grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy), BAR[dtype])
    assert not out[4][E - 1].any() and not out[2][E - 1].any()  # the expert without tokens gets zero


def test_wgrad_launch_orders_agree():
    """The wgrad tiles launched expert by expert (the default), expert-fastest (the first order) and walked by a
    few persistent programs give the same gradients bit for bit, each against float64."""
    from mlp_fuser.kernels.moe_backward import backward_config

    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES["silu_concat"]
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, H, I, torch.float32, gated, bias, transposed)
    outs = []
    orders = ({"EXPERT_MAJOR": True}, {"EXPERT_MAJOR": False}, {"PERSISTENT": 1}, {"PERSISTENT": 2, "FLATTEN": True})
    for extra in orders:
        cfg = backward_config("wgrad", 16, torch.float32) | extra
        with poisoned_empty():
            outs.append(moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, configs={"wgrad": cfg}))
        check(outs[-1], grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy), BAR[torch.float32])
    assert all(a is None and b is None or torch.equal(a, b) for out in outs[1:] for a, b in zip(outs[0], out))


def test_every_pair_dropped():
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(5, 2, 4, 24, 16, torch.float32, bias=True)
    ids = torch.full_like(ids, 4)
    with poisoned_empty():
        out = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, ExpertAct("silu"), False, dy)
    for name, g in zip(NAMES, out):
        assert torch.equal(g, torch.zeros_like(g)), name


def test_autograd_function():
    """The differentiable wrapper: its forward and every gradient through .backward()."""
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(31, 4, 8, 40, 24, torch.float32, bias=True, seed=1)
    leaves = [t.clone().requires_grad_() for t in (x, wts, w_gu, b_gu, w_d, b_d)]
    with poisoned_empty():
        y = moe_experts_autograd(leaves[0], ids, *leaves[1:3], leaves[3], leaves[4], leaves[5], ExpertAct("silu"))
        y.backward(dy)
    gate = Gate("silu")
    y_ref = reference(*(t.double() if t.is_floating_point() else t for t in (x, ids, wts, w_gu, b_gu, w_d, b_d)), gate)
    assert rel_err(y.detach(), y_ref) <= 1e-5
    check([t.grad for t in leaves], grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy), BAR[torch.float32])


def test_forward_routing_strided_dy_and_frozen_weights():
    """A routing of another BLOCK_M passed in, dy through strides; without weight gradients only dx and dwts."""
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(40, 3, 6, 48, 40, torch.float32, bias=True, seed=2)
    dy = dy.t().contiguous().t()
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, Gate("silu"), dy)
    with poisoned_empty():
        out = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, ExpertAct("silu"), False, dy, moe_align(ids, 6, 32))
    check(out, ref, BAR[torch.float32])
    with poisoned_empty():
        out = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, ExpertAct("silu"), False, dy, need_weights=False)
    assert out[2:] == (None,) * 4
    check(out[:2], ref[:2], BAR[torch.float32])


def test_autograd_function_frozen_experts():
    """Experts frozen (LoRA-style): gradients reach x and the routing weights only."""
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(17, 2, 4, 24, 16, torch.float32, seed=3)
    xg, wg = x.clone().requires_grad_(), wts.clone().requires_grad_()
    with poisoned_empty():
        moe_experts_autograd(xg, ids, wg, w_gu, None, w_d, None).backward(dy)
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, Gate("silu"), dy)
    check([xg.grad, wg.grad], ref[:2], BAR[torch.float32])


def test_float64_raises_not_implemented():
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(3, 2, 4, 16, 8, torch.float64)
    with pytest.raises(NotImplementedError, match="float64"):
        moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, ExpertAct("silu"), False, dy)


# ---- the op's autograd: mlp_fuser.moe_mlp with gradients runs the Triton backward where the dispatcher chooses it --


@pytest.fixture
def triton_backward(monkeypatch):
    """The Triton rows allowed on CPU tensors (the interpreter), the choices forgotten before and after."""
    from mlp_fuser import config
    from mlp_fuser.ops import moe

    monkeypatch.setattr(config, "triton_on_cpu", True)
    moe.reset()
    yield
    moe.reset()


@pytest.fixture
def triton_calls(triton_backward, monkeypatch):
    """``triton_backward``, and the list of the Triton backward's calls (their need_dx, need_weights)."""
    from mlp_fuser.kernels import moe_backward as kbwd

    calls, real = [], kbwd.moe_backward
    monkeypatch.setattr(kbwd, "moe_backward", lambda *a, **k: calls.append((k["need_dx"], k["need_weights"]))
                        or real(*a, **k))
    return calls


@pytest.fixture
def forced_triton(triton_calls, monkeypatch):
    """``triton_calls``, with the Triton backward forced: on CUDA the dispatcher may time the aten rows faster on
    these tiny shapes."""
    from mlp_fuser import config

    monkeypatch.setattr(config, "force_impl", "triton_moe_backward")
    return triton_calls


def uneven_ids(T, k, E, seed):
    """Routing as a skewed router gives it: expert 0 in about 60% of the tokens, the last expert in none, about 10%
    sentinel ids (>= E), distinct experts per token where the draw allows."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(T)])
    many = torch.rand(T, generator=gen) < 0.6
    ids[:, 0] = torch.where(many, 0, ids[:, 0])
    ids[:, 1:] = torch.where(many[:, None] & (ids[:, 1:] == 0), E - 2, ids[:, 1:])
    return torch.where(torch.rand((T, k), generator=gen) < 0.1, sentinels(gen, (T, k), E), ids)


OP_CASES = {  # T, k, E, H, I, activation, gated, bias
    "gated_top1": (26, 1, 5, 40, 24, "silu", True, False),
    "gated_top2_bias": (23, 2, 6, 32, 40, "silu", True, True),
    "plain_top2": (21, 2, 5, 36, 20, "gelu", False, False),
    "plain_top1_bias": (19, 1, 4, 24, 16, "gelu_tanh", False, True),
}
OP_DTYPE_CASES = [(n, dt) for dt in KERNEL_DTYPES for n in OP_CASES
                  if dt == torch.float32 or KERNEL_DEVICE == "cuda" or n in ("gated_top2_bias", "plain_top1_bias")]


def op_case(name, dtype, seed):
    T, k, E, H, I, act, gated, bias = OP_CASES[name]
    gen = torch.Generator().manual_seed(seed)
    x, w_gu, b_gu, w_d, b_d = expert_tensors(gen, T, E, H, I, gated, bias)
    wts = torch.rand((T, k), generator=gen)
    dy = torch.randn((T, H), generator=gen)
    ids = uneven_ids(T, k, E, seed)
    tensors = [t.to(dtype).to(KERNEL_DEVICE) if t is not None else None for t in (x, wts, w_gu, b_gu, w_d, b_d, dy)]
    return ids.to(KERNEL_DEVICE), act, Gate(act, gated=gated), tensors


@pytest.mark.parametrize(("name", "dtype"), OP_DTYPE_CASES, ids=[f"{n}-{dt}" for n, dt in OP_DTYPE_CASES])
def test_op_gradients_through_triton_backward(forced_triton, name, dtype):
    """Every input's gradient through mlp_fuser.moe_mlp against float64 autograd through the aten reference, with an
    expert that gets most tokens and one that gets none; the backward that ran is the Triton one."""
    import mlp_fuser

    ids, act, gate, (x, wts, w_gu, b_gu, w_d, b_d, dy) = op_case(name, dtype, seed=len(name))
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, wts)]
    leaves += [torch.nn.Parameter(t.clone()) if t is not None else None for t in (w_gu, b_gu, w_d, b_d)]  # a model's
    with poisoned_empty():
        y = mlp_fuser.moe_mlp(leaves[0], ids, *leaves[1:], act)
        y.backward(dy)
    assert forced_triton == [(True, True)]
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy)
    check([t.grad if t is not None else None for t in leaves], ref, BAR[dtype])
    y64 = reference(*(t.cpu().double() if t.is_floating_point() else t.cpu()
                      for t in (x, ids, wts, w_gu)), *(t.cpu().double() if t is not None else None
                                                        for t in (b_gu, w_d, b_d)), gate)
    assert rel_err(y.detach().cpu(), y64) <= BAR[dtype]
    E = w_gu.shape[0]
    assert not leaves[2].grad[E - 1].any() and leaves[2].grad[0].abs().sum() > 0  # none for the unused expert


def test_op_frozen_experts_and_3d_input(forced_triton):
    """Frozen experts (LoRA elsewhere): gradients reach x and the routing weights only; x with two leading dims."""
    import mlp_fuser

    ids, act, gate, (x, wts, w_gu, b_gu, w_d, b_d, dy) = op_case("gated_top2_bias", torch.float32, seed=7)
    xg, wg = x.clone().view(1, *x.shape).requires_grad_(), wts.clone().view(1, *wts.shape).requires_grad_()
    with poisoned_empty():
        y = mlp_fuser.moe_mlp(xg, ids.view(1, *ids.shape), wg, w_gu, b_gu, w_d, b_d, act)
        y.backward(dy.view(1, *dy.shape))
    assert forced_triton == [(True, False)]
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy)
    check([xg.grad.view(x.shape), wg.grad.view(wts.shape)], ref[:2], BAR[torch.float32])


def test_op_double_backward_through_aten(triton_calls):
    """create_graph=True: every gradient from the aten path, which can be differentiated again (float64 alike)."""
    import mlp_fuser

    ids, act, gate, tensors = op_case("gated_top2_bias", torch.float32, seed=3)
    dy = tensors[-1]
    outs = []
    for dt in (torch.float32, torch.float64):
        leaves = [t.detach().to(dt).requires_grad_() for t in tensors[:-1]]
        y = mlp_fuser.moe_mlp(leaves[0], ids, *leaves[1:], act)
        grads = torch.autograd.grad(y, leaves, dy.to(dt), create_graph=True)
        assert not triton_calls
        outs.append((*grads, *torch.autograd.grad((grads[0] * grads[0]).sum(), leaves[4])))
    for name, got, want in zip((*NAMES, "d(dx²)/dw_d"), *outs):
        assert rel_err(got, want) <= BAR[torch.float32], name


def test_backward_table_reasons_and_fallbacks(triton_calls, monkeypatch):
    """The dispatcher's rows for calls with gradients: the Triton one where Triton runs, the aten path otherwise
    (float64, CPU without the interpreter's opt-in), each with its reason."""
    import mlp_fuser
    from mlp_fuser import config
    from mlp_fuser.dispatch import core, experts
    from mlp_fuser.ops import moe

    gate = Gate("silu")
    p = experts.StepProblem("cpu", torch.float64, 8, 2, 4, 16, 8, gate, False, True, True)
    assert experts.BACKWARD_BY_NAME["triton_moe_backward"].why_not(p) == "dtype torch.float64 not supported"
    assert [i.name for i in core.candidates(experts.BACKWARD, p)] == ["reference"]
    ids, act, gate, (x, wts, w_gu, b_gu, w_d, b_d, dy) = op_case("gated_top1", torch.float64, seed=1)
    mlp_fuser.moe_mlp(x.requires_grad_(), ids, wts, w_gu, None, w_d, None, act).backward(dy)
    assert x.grad is not None and not triton_calls
    monkeypatch.setattr(config, "triton_on_cpu", False)
    moe.reset()
    assert "device cpu" in experts.BACKWARD_BY_NAME["triton_moe_backward"].why_not(
        experts.StepProblem("cpu", torch.float32, 8, 2, 4, 16, 8, gate, False, True, True))
    x, ids, wts, w_gu, w_d, dy = (t.cpu() for t in (x, ids, wts, w_gu, w_d, dy))  # CPU without the opt-in
    wf = wts.float().requires_grad_()
    mlp_fuser.moe_mlp(x.float(), ids, wf, w_gu.float(), None, w_d.float(), None, act).backward(dy.float())
    assert wf.grad is not None and not triton_calls



def test_op_checkpointed_and_autocast_over_fp32_weights(forced_triton):
    """As fine-tuning runs it: activation checkpointing (non-reentrant) and fp16 autocast over fp32 master weights,
    the gradients reaching the fp32 leaves through the casts, within fp16's bar."""
    import mlp_fuser

    ids, act, gate, (x, wts, w_gu, b_gu, w_d, b_d, dy) = op_case("gated_top2_bias", torch.float32, seed=11)
    leaves = [torch.nn.Parameter(t.clone()) for t in (x, wts, w_gu, b_gu, w_d, b_d)]

    def f(xx, ww, wgu, bgu, wd, bd):
        return mlp_fuser.moe_mlp(xx, ids, ww, wgu, bgu, wd, bd, act)

    with torch.autocast(KERNEL_DEVICE, dtype=torch.float16), poisoned_empty():
        y = torch.utils.checkpoint.checkpoint(f, *leaves, use_reentrant=False)
    assert y.dtype == torch.float16
    y.backward(dy.half())
    assert forced_triton == [(True, True)]
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy)
    assert all(t.grad.dtype == torch.float32 for t in leaves)
    check([t.grad for t in leaves], ref, BAR[torch.float16])


# ---- the backward as an op of its own: mlp_fuser::moe_mlp_backward, what eager and compiled graphs both call ------

OP_BACKWARD = [  # a case of CASES, need_dx, need_weights, the Triton row (else the aten one)
    ("silu_concat", True, True, False),
    ("gelu_interleaved_bias_transposed", True, True, False),
    ("gpt_oss_clamped", True, False, False),  # frozen experts
    ("plain_gelu_bias", False, False, False),  # the routing weights' gradient alone
    ("gelu_interleaved_bias_transposed", True, True, True),
    ("silu_clamp_after", False, True, True),
]


@pytest.mark.parametrize(("name", "need_dx", "need_weights", "triton"), OP_BACKWARD,
                         ids=[f"{c[0]}-{'dx' if c[1] else ''}{'dw' if c[2] else ''}-{'triton' if c[3] else 'aten'}"
                              for c in OP_BACKWARD])
def test_backward_op_matches_float64_and_opcheck(monkeypatch, name, need_dx, need_weights, triton):
    """The op's six gradients (empty where not asked) against float64 autograd, through the row the table names;
    then torch.library.opcheck: schema, fake kernel against the real one, AOT dispatch."""
    from mlp_fuser import config
    from mlp_fuser.ops import moe

    monkeypatch.setattr(config, "triton_on_cpu", triton)
    monkeypatch.setattr(config, "force_impl", None)
    monkeypatch.setattr(config, "autotune", False)  # on CUDA: the table's first eligible row, not the faster
    moe.reset()
    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES[name]
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, H, I, torch.float32, gated, bias, transposed, seed=5,
                                                      device=KERNEL_DEVICE if triton else "cpu")
    args = (dy, x, ids, wts, w_gu, b_gu, w_d, b_d, gate.activation, gate.interleaved, gate.limit, gate.clamp_after,
            gate.up_offset, need_dx, need_weights)
    op = torch.ops.mlp_fuser.moe_mlp_backward.default
    with poisoned_empty():
        out = op(*args)
    p = moe.experts.problem(x, ids, w_gu, w_d, b_gu, b_d, gate, need_dx, need_weights)
    assert moe.experts.choose_backward(p, (x, ids, wts, w_gu, b_gu, w_d, b_d, gate)).name == (
        "triton_moe_backward" if triton else "reference")
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy)
    wanted = (need_dx, True, need_weights, need_weights and bias, need_weights, need_weights and bias)
    check([o if w else None for o, w in zip(out, wanted)], [r if w else None for r, w in zip(ref, wanted)],
          BAR[torch.float32])
    assert all(o.shape == (0,) for o, w in zip(out, wanted) if not w)
    torch.library.opcheck(op, args)
    moe.reset()


@pytest.mark.parametrize("triton", [False, True])
def test_weight_gradients_come_in_the_weights_layout(monkeypatch, triton):
    """GPT-OSS's weights reach the op as transposed views of its (E, H, 2I) and (E, I, H) parameters: their
    gradients come back in those views' strides, so a parameter's .grad is the op's output as it is (AccumulateGrad
    clones a gradient laid out otherwise: a weight-sized copy a step). Both rows: the Triton backward (written in
    place), the aten reference (copied once into the layout)."""
    from mlp_fuser import config
    from mlp_fuser.ops import moe

    monkeypatch.setattr(config, "triton_on_cpu", triton)
    monkeypatch.setattr(config, "autotune", False)
    moe.reset()
    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES["gpt_oss_clamped"]
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, H, I, torch.float32, gated, bias, transposed, seed=7,
                                                      device=KERNEL_DEVICE if triton else "cpu")
    assert w_gu.stride(1) == 1 and w_d.stride(1) == 1  # the views of transposed storage
    out = torch.ops.mlp_fuser.moe_mlp_backward.default(
        dy, x, ids, wts, w_gu, b_gu, w_d, b_d, gate.activation, gate.interleaved, gate.limit, gate.clamp_after,
        gate.up_offset, True, True)
    assert out[2].stride() == w_gu.stride() and out[4].stride() == w_d.stride()
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy)
    check(out, ref, BAR[torch.float32])
    moe.reset()


def test_op_under_torch_func_grad():
    """torch.func.grad through the op (and patch's eager entry) takes the aten path the transforms see through: the
    gradients of x and the routing weights equal autograd's on the float64 reference."""
    from mlp_fuser.ops import moe as moe_ops

    g = torch.Generator().manual_seed(21)
    T, k, E, H, I = 5, 2, 4, 32, 16
    x = torch.randn(2, T, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, E, (2, T, k), generator=g)
    wts = torch.rand(2, T, k, generator=g, dtype=torch.float64)
    wgu = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) * H**-0.5
    wd = torch.randn(E, H, I, generator=g, dtype=torch.float64) * I**-0.5
    dy = torch.randn(2, T, H, generator=g, dtype=torch.float64)

    def ref(x, wts):
        y = reference(x.reshape(-1, H), ids.reshape(-1, k), wts.reshape(-1, k), wgu, None, wd, None, Gate("silu"))
        return (y.reshape(x.shape) * dy).sum()

    xr, wr = x.clone().requires_grad_(), wts.clone().requires_grad_()
    want = torch.autograd.grad(ref(xr, wr), (xr, wr))
    for entry in (moe_ops.moe_mlp, moe_ops.eager_moe_mlp):
        got = torch.func.grad(lambda x, wts, f=entry: (f(x, ids, wts, wgu, None, wd, None, "silu") * dy).sum(),
                              argnums=(0, 1))(x, wts)
        assert all(rel_err(a, b) < 1e-12 for a, b in zip(got, want))


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("pairs", [8192, 65536])
def test_wgrad_config_fits_shared_memory(monkeypatch, block_m, pairs):
    """The GPU's wgrad tiles (from the H100 sweep) fit 200 KB of shared memory at every routing block, and the large
    tile is taken only from 32768 pairs."""
    from mlp_fuser.kernels import moe_backward as kbwd

    monkeypatch.setattr(kbwd, "INTERPRET", False)
    cfg = kbwd.backward_config("wgrad", block_m, torch.bfloat16, pairs)
    assert cfg["num_stages"] * block_m * (cfg["BLOCK_N"] + cfg["BLOCK_K"]) * 2 <= 200 * 1024
    assert cfg["BLOCK_K"] == (256 if pairs >= 32768 else 128)
