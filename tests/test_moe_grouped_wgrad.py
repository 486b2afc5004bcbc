"""The experts' backward with its weight gradients by torch's grouped GEMM (mlp_fuser.kernels.moe_grouped_wgrad, the
``triton_moe_backward_grouped_wgrad`` row) against float64 autograd through the aten reference, every gradient."""

import pytest
import torch
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, poisoned_empty
from test_moe_backward import BAR, CASES, check, grads64, make_case, op_case

from mlp_fuser.kernels import moe_grouped_wgrad as gw
from mlp_fuser.kernels.moe import ExpertAct
from mlp_fuser.kernels.moe_backward import moe_backward
from mlp_fuser.ops.moe import Gate

ROW = "triton_moe_backward_grouped_wgrad"


def _to8(n):  # grouped_mm's operands: rows of a multiple of 16 bytes
    return -(-n // 8) * 8


DTYPE_CASES = [(n, dt) for dt in KERNEL_DTYPES for n in CASES]


@pytest.mark.parametrize(("name", "dtype"), DTYPE_CASES, ids=[f"{n}-{dt}" for n, dt in DTYPE_CASES])
def test_grouped_wgrad_matches_float64_autograd(name, dtype):
    """Every case of the Triton backward's tests (H and I rounded up to multiples of 8): sentinel ids, an expert
    without tokens, biases, interleaved and transposed weights, the clamps; dx and dwts bit for bit the Triton
    row's (the same kernels), the weight and bias gradients by grouped_mm against float64."""
    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES[name]
    H, I = _to8(H), _to8(I)
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, H, I, dtype, gated, bias, transposed)
    reason = gw.why_not(x.device, dtype, E, H, I)
    if reason is not None:  # on a GPU: the dtypes torch's CUTLASS kernel does not take say so
        with pytest.raises(NotImplementedError, match="grouped_mm"):
            moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, wgrad="grouped")
        return
    with poisoned_empty():
        out = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, wgrad="grouped")
        tri = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy)
    check(out, grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy), BAR[dtype])
    assert torch.equal(out[0], tri[0]) and torch.equal(out[1], tri[1])
    assert not out[4][E - 1].any() and not out[2][E - 1].any()  # the expert without tokens gets zero
    if bias:
        assert not out[3][E - 1].any() and not out[5][E - 1].any()


def test_grouped_wgrad_every_pair_dropped_and_frozen():
    """Every id a sentinel: zero gradients (every expert's run empty); without weight gradients it is the Triton
    backward's work, and the row says so."""
    from mlp_fuser.dispatch import experts

    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(5, 2, 4, 24, 16, torch.float32, bias=True)
    if gw.why_not(x.device, x.dtype, 4, 24, 16) is not None:  # a GPU: fp32 is not the CUTLASS kernel's
        x, wts, w_gu, b_gu, w_d, b_d, dy = (t.bfloat16() for t in (x, wts, w_gu, b_gu, w_d, b_d, dy))
    silu = ExpertAct("silu")
    with poisoned_empty():
        out = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, silu, False, dy, wgrad="grouped")
        ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, Gate("silu"), dy)
        check(out, ref, BAR[x.dtype])
        gone = moe_backward(x, ids, torch.zeros_like(wts), w_gu, b_gu, w_d, b_d, silu, False, dy, wgrad="grouped")
        dropped = moe_backward(x, torch.full_like(ids, 4), wts, w_gu, b_gu, w_d, b_d, silu, False, dy,
                               wgrad="grouped")
        frozen = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, silu, False, dy, wgrad="grouped",
                              need_weights=False)
    assert not gone[4].any() and not gone[5].any()  # every routing weight 0: no dWd, no dbd
    for g in dropped:
        assert torch.equal(g, torch.zeros_like(g))
    assert frozen[2:] == (None,) * 4
    check(frozen[:2], ref[:2], BAR[x.dtype])
    p = experts.StepProblem("cpu", torch.float32, 5, 2, 4, 24, 16, Gate("silu"), True, True, False)
    assert experts.BACKWARD_BY_NAME[ROW].not_worth(p).startswith("frozen experts")


def test_why_not_says_what_grouped_mm_cannot_run(monkeypatch):
    """The reasons: strides of a multiple of 16 bytes anywhere; on CUDA bfloat16 on sm90 only, fewer than 1024
    experts (the rest is torch's fallback with a host sync, or sm100's wrong empty experts)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert gw.why_not(cpu, torch.float32, 8, 36, 20) is None  # 4 floats: 16 bytes
    assert "multiples of 8" in gw.why_not(cpu, torch.float16, 8, 36, 24)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    assert gw.why_not(cuda, torch.bfloat16, 128, 2048, 768) is None
    assert "bfloat16 only" in gw.why_not(cuda, torch.float16, 128, 2048, 768)
    assert "fewer than 1024" in gw.why_not(cuda, torch.bfloat16, 1024, 2048, 768)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "sm90 only" in gw.why_not(cuda, torch.bfloat16, 128, 2048, 768)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "sm_80" in gw.why_not(cuda, torch.bfloat16, 128, 2048, 768)
    from mlp_fuser.dispatch import experts

    p = experts.StepProblem("cuda", torch.bfloat16, 64, 8, 128, 2048, 768, Gate("silu"), False, True, True)
    assert "sm90 only" in experts.BACKWARD_BY_NAME[ROW].why_not(p)


# ---- through the op: mlp_fuser.moe_mlp with gradients, the row forced -------------------------------------------


@pytest.fixture
def forced_row(monkeypatch):
    """The Triton rows allowed on CPU tensors (the interpreter), this row forced, the choices forgotten around; the
    list of moe_backward's calls (need_dx, need_weights, wgrad)."""
    from mlp_fuser import config
    from mlp_fuser.kernels import moe_backward as kbwd
    from mlp_fuser.ops import moe

    monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(config, "force_impl", ROW)
    calls, real = [], kbwd.moe_backward
    monkeypatch.setattr(kbwd, "moe_backward", lambda *a, **k: calls.append((k["need_dx"], k["need_weights"],
                                                                             k["wgrad"])) or real(*a, **k))
    moe.reset()
    yield calls
    moe.reset()


OP_CASES = [("gated_top1", torch.float32), ("gated_top2_bias", torch.float32), ("plain_top1_bias", torch.float32),
            ("gated_top2_bias", torch.float16)] + [("gated_top2_bias", torch.bfloat16)] * (KERNEL_DEVICE == "cuda")


@pytest.mark.parametrize(("name", "dtype"), OP_CASES, ids=[f"{n}-{dt}" for n, dt in OP_CASES])
def test_op_gradients_through_the_row(forced_row, name, dtype):
    """Every input's gradient through mlp_fuser.moe_mlp (weights as a model's Parameters, skewed routing with an
    unused expert) against float64 autograd; frozen experts: dx and the routing weights' only."""
    import mlp_fuser

    ids, act, gate, (x, wts, w_gu, b_gu, w_d, b_d, dy) = op_case(name, dtype, seed=len(name))
    E, H, I = w_d.shape
    if gw.why_not(x.device, dtype, E, H, I) is not None:  # on a GPU: forcing the row is refused with the reason
        with pytest.raises(ValueError, match=ROW):
            mlp_fuser.moe_mlp(x.requires_grad_(), ids, wts, w_gu, b_gu, w_d, b_d, act).sum().backward()
        return
    leaves = [t.clone().requires_grad_() for t in (x, wts)]
    leaves += [torch.nn.Parameter(t.clone()) if t is not None else None for t in (w_gu, b_gu, w_d, b_d)]
    with poisoned_empty():
        mlp_fuser.moe_mlp(leaves[0], ids, *leaves[1:], act).backward(dy)
        xg, wg = x.clone().requires_grad_(), wts.clone().requires_grad_()
        mlp_fuser.moe_mlp(xg, ids, wg, w_gu, b_gu, w_d, b_d, act).backward(dy)
    assert forced_row == [(True, True, "grouped"), (True, False, "grouped")]
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy)
    check([t.grad if t is not None else None for t in leaves], ref, BAR[dtype])
    check([xg.grad, wg.grad], ref[:2], BAR[dtype])
    assert not leaves[2].grad[E - 1].any() and leaves[2].grad[0].abs().sum() > 0


def test_backward_op_through_the_row_opchecks(forced_row):
    """mlp_fuser::moe_mlp_backward through the row: its six gradients against float64, then torch.library.opcheck."""
    from mlp_fuser.ops import moe

    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES["gelu_interleaved_bias_transposed"]
    dtype = torch.float32 if KERNEL_DEVICE == "cpu" else torch.bfloat16
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, 32, I, dtype, gated, bias, transposed, seed=5)
    args = (dy, x, ids, wts, w_gu, b_gu, w_d, b_d, gate.activation, gate.interleaved, gate.limit, gate.clamp_after,
            gate.up_offset, True, True)
    op = torch.ops.mlp_fuser.moe_mlp_backward.default
    p = moe.experts.problem(x, ids, w_gu, w_d, b_gu, b_d, gate, True, True)
    if gw.why_not(x.device, dtype, E, 32, I) is not None:  # a GPU other than sm90: forcing it is refused
        with pytest.raises(ValueError, match=ROW):
            op(*args)
        return
    with poisoned_empty():
        out = op(*args)
    assert moe.experts.choose_backward(p, (x, ids, wts, w_gu, b_gu, w_d, b_d, gate)).name == ROW
    check(out, grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy), BAR[dtype])
    torch.library.opcheck(op, args)
